"""Packed forwards: several sequences end to end in one row, each attending only to itself.

A padded forward runs B rows of the longest request's length T; every position past a row's own end is
device time for nothing, and the take order that keeps caller batches completing one after another pads more
than a plain length-sorted loop (bench/results/take_simulation_head_benchmix.json,
take_simulation_head_longtail.json). Packed, a forward is the requests themselves, one after another, [1, N]:

- positions restart at 0 for every sequence (`position_ids`), so rotary embeddings are each sequence's own;
- attention is causal within each sequence and never crosses into another: on CUDA one variable-length
  flash-attention call over the cumulative lengths (`cu_seqlens`, FlashAttention-2 as torch ships it, GQA
  included); elsewhere one scaled-dot-product call per sequence, which is the unpadded forward itself;
- every other operation of a decoder layer (norms, MLPs, MoE routing) works token by token, so it cannot
  tell packed from padded.

transformers routes attention through its `AttentionInterface` by name; the packed forward registers one
(`PACKED`) that runs the variable-length kernel while a packed forward is active on this thread and the
library's sdpa function otherwise. No mask is built for it (transformers builds none for a name it has no
mask function for), and nothing in it waits for the device: the lengths go up from pinned memory.

On by default on CUDA (engine.packing unset is auto there; off on a CPU, where it is unmeasured). The kernel
alone does not pay for it: the variable-length flash kernel is slower per token than the cuDNN kernel a padded
forward's attention runs (bench/results/packed_attention_longtail_h200.json), and the bare engine is no faster
packed (bench/results/longtail_packed_varlen_h200.json). A job is not the bare engine's best pass: its
forwards are shapes new to the process, whose padded attention either waits for cuDNN's per-shape plan or runs
the flash kernel in its place (decoder.py, cudnn_attention), and its take order pads more. Packed forwards need
no plan and carry no padding, and a job packed comes closer to the bare engine than one padded
(bench/results/benchmix_packed_default_h100.json, longtail_packed_default_h100.json). Grouping the row's
sequences into padded calls of the cuDNN kernel was no faster and added host work
(bench/results/longtail_packed_grouped_h200.json).

What it cannot run: per-layer sliding windows, logit soft-capping, attention sinks, and heads whose values
are narrower than their keys (MLA). `refusal(config)` names those from the config; the engine also checks
a packed forward against a padded one at start (actors/hf/pack_check.py) and runs padded where they
differ, so a family this module does not know about is caught by what it computes, not by its name.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

PACKED = "hidden_harvest_packed"

_active = threading.local()  # .spans: the packed forward running on this thread, or None


@dataclass(frozen=True)
class Spans:
    """Where each sequence of a packed row lies: starts[i]..starts[i + 1] (host), and on CUDA the same
    cumulative lengths as a device int32 tensor for the kernel."""

    starts: np.ndarray  # int64 [R + 1]
    longest: int
    cu_seqlens: object = None

    @classmethod
    def of(cls, lengths: Sequence[int], device: str) -> Spans:
        starts = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
        cu = None
        if device.startswith("cuda"):
            import torch

            cu = torch.from_numpy(starts.astype(np.int32)).pin_memory().to(device, non_blocking=True)
        return cls(starts, int(max(lengths)), cu)


class active:
    """`with active(spans):` the packed attention reads these spans on this thread."""

    def __init__(self, spans: Spans):
        self.spans = spans

    def __enter__(self) -> Spans:
        _active.spans = self.spans
        return self.spans

    def __exit__(self, *exc) -> None:
        _active.spans = None


def refusal(config) -> str | None:
    """Why this model's attention cannot run packed, from its config; None where nothing says so."""
    for name in ("attn_logit_softcapping", "final_logit_softcapping"):
        if getattr(config, name, None):
            return f"{name} is set (soft-capped attention)"
    layer_types = getattr(config, "layer_types", None) or ()
    if any(t != "full_attention" for t in layer_types):
        return f"layer types {sorted(set(layer_types))} (windowed or chunked attention)"
    if getattr(config, "sliding_window", None) and getattr(config, "use_sliding_window", True):
        return f"sliding_window {config.sliding_window}"
    if getattr(config, "v_head_dim", None) and getattr(config, "qk_head_dim", None) not in (None, config.v_head_dim):
        return "value heads narrower than query/key heads (MLA)"
    return None


def packed_attention(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None, **kwargs):
    """transformers' attention function contract: query [1, Hq, N, D], key/value [1, Hkv, N, D] -> output
    [1, N, Hq, D] and no weights. Outside a packed forward it is the library's sdpa function."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    spans = getattr(_active, "spans", None)
    if spans is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout, scaling, **kwargs)
    if kwargs.get("sliding_window") or kwargs.get("softcap") or getattr(module, "sinks", None) is not None:
        raise NotImplementedError("packed attention: sliding windows, soft-capping and sinks are not supported")
    if value.shape[-1] != query.shape[-1] or query.shape[0] != 1:
        raise NotImplementedError(f"packed attention: query {tuple(query.shape)}, value {tuple(value.shape)}")
    if query.is_cuda:
        return _flash_varlen(query, key, value, spans, scaling), None
    return _per_sequence(query, key, value, spans, scaling), None


def _flash_varlen(query, key, value, spans: Spans, scaling):
    import torch

    # [1, H, N, D] -> [N, H, D]: the kernel's layout (only the last dimension need be contiguous).
    q, k, v = (x[0].transpose(0, 1) for x in (query, key, value))
    out = torch.ops.aten._flash_attention_forward(
        q, k, v, spans.cu_seqlens, spans.cu_seqlens, spans.longest, spans.longest, 0.0, True, False, scale=scaling
    )[0]
    return out.unsqueeze(0)


def _per_sequence(query, key, value, spans: Spans, scaling):
    """Each sequence alone through torch's scaled-dot-product attention: exactly its unpadded forward."""
    import torch
    import torch.nn.functional as F

    groups = query.shape[1] // key.shape[1]
    parts = []
    for a, b in zip(spans.starts[:-1].tolist(), spans.starts[1:].tolist()):
        k, v = key[:, :, a:b], value[:, :, a:b]
        if groups > 1:
            k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
        parts.append(F.scaled_dot_product_attention(query[:, :, a:b], k, v, is_causal=True, scale=scaling))
    return torch.cat(parts, dim=2).transpose(1, 2).contiguous()


def register() -> None:
    """Makes PACKED a name transformers' models accept for their attention (idempotent)."""
    from transformers import AttentionInterface

    AttentionInterface.register(PACKED, packed_attention)

"""Packed forwards: several sequences end to end in one row, each attending only to itself.

A padded forward runs B rows of the longest request's length T; every position past a row's own end is
device time for nothing (2-6 % of a job's forwards on the H200 mixes, and the take order that keeps caller
batches completing one after another pads more than a plain length-sorted loop: bench/results/
take_simulation_head_*.json). Packed, a forward is the requests themselves, one after another, [1, N]:

- positions restart at 0 for every sequence (`position_ids`), so rotary embeddings are each sequence's own;
- attention is causal within each sequence and never crosses into another: the row's sequences are gathered
  into a few groups of similar length (`buckets`), each group one right-padded scaled-dot-product call,
  and scattered back. Attention is ~5 % of an 8B forward's work, so its padding costs little, while torch's
  variable-length flash kernel ran at half the speed of the cuDNN kernel torch picks for padded rows on the
  H200 (bench/results/packed_attention_*_h200.json);
- every other operation of a decoder layer (norms, MLPs, MoE routing) works token by token, so it cannot
  tell packed from padded.

transformers routes attention through its `AttentionInterface` by name; the packed forward registers one
(`PACKED`) that runs the variable-length kernel while a packed forward is active on this thread and the
library's sdpa function otherwise. No mask is built for it (transformers builds none for a name it has no
mask function for), and nothing in it waits for the device: the gather and scatter indices go up from
pinned memory once per forward.

What it cannot run: per-layer sliding windows, logit soft-capping, attention sinks, and heads whose values
are narrower than their keys (MLA). `refusal(config)` names those from the config; the engine also checks
a packed forward against a padded one at start (`HFEngine._check_packing`) and runs padded where they
differ, so a family this module does not know about is caught by what it computes, not by its name.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

PACKED = "hidden_harvest_packed"

_active = threading.local()  # .spans: the packed forward running on this thread, or None


# Sequences share one padded attention call while padding it costs at most this share of their own attention
# (causal attention costs ~n² per sequence of n tokens), or less than one sequence of BUCKET_FREE_TOKENS would.
BUCKET_SLACK = 0.1
BUCKET_FREE_TOKENS = 256


def buckets(lengths: Sequence[int]) -> list[list[int]]:
    """The packed row's sequences (indices) grouped for padded attention calls: longest first, each joining the
    open group while the group's padded attention (rows x longest²) stays within BUCKET_SLACK of its
    sequences' own, or adds less than a BUCKET_FREE_TOKENS sequence would."""
    groups: list[list[int]] = []
    longest = own = 0
    for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        n = lengths[i]
        waste = (len(groups[-1]) + 1) * longest * longest - (own + n * n) if groups else 0
        if groups and waste <= max(BUCKET_SLACK * (own + n * n), BUCKET_FREE_TOKENS**2):
            groups[-1].append(i)
            own += n * n
        else:
            groups.append([i])
            longest, own = n, n * n
    return groups


@dataclass(frozen=True)
class Spans:
    """Where each sequence of a packed row lies (starts[i]..starts[i + 1]), and how attention runs over them:
    the row's tokens gathered into padded groups (`gather`: for every slot of every group [rows, longest] in
    turn, the row position it reads; padded slots read the group's first token, which no real position sees
    under causal attention) and back (`scatter`: for every row position, its slot)."""

    starts: np.ndarray  # int64 [R + 1]
    shapes: tuple[tuple[int, int], ...]  # (rows, longest) per group
    gather: object  # int64 [sum rows * longest], on the row's device
    scatter: object  # int64 [N]

    @classmethod
    def of(cls, lengths: Sequence[int], device: str) -> Spans:
        import torch

        starts = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
        gather, shapes = [], []
        scatter = np.empty(int(starts[-1]), dtype=np.int64)
        slot = 0
        for group in buckets(lengths):
            longest = lengths[group[0]]
            shapes.append((len(group), longest))
            for i in group:
                n, a = lengths[i], int(starts[i])
                gather.append(np.concatenate([np.arange(a, a + n), np.full(longest - n, int(starts[group[0]]))]))
                scatter[a : a + n] = np.arange(slot, slot + n)
                slot += longest
        both = torch.from_numpy(np.concatenate([*gather, scatter]))
        if device.startswith("cuda"):  # one upload, queued behind the device's work: nothing waits
            both = both.pin_memory().to(device, non_blocking=True)
        return cls(starts, tuple(shapes), both[:slot], both[slot:])


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
    return _grouped(query, key, value, spans, scaling), None


def _grouped(query, key, value, spans: Spans, scaling):
    """Each group of sequences (buckets) as right-padded rows through torch's scaled-dot-product attention,
    causal, no mask: the same call as a padded forward, so the same kernel (cuDNN's on the H200, twice as
    fast there as the variable-length flash kernel torch ships: bench/results/packed_attention_*_h200.json).
    Under causal attention a real position sees only earlier positions of its own row, all its own sequence's."""
    import torch
    import torch.nn.functional as F

    # Token-major [N, H, D] views; one gather per tensor for every group.
    q, k, v = (x[0].transpose(0, 1).index_select(0, spans.gather) for x in (query, key, value))
    out, at = [], 0
    for rows, longest in spans.shapes:
        size = rows * longest
        part = [x[at : at + size].view(rows, longest, x.shape[1], x.shape[2]).transpose(1, 2) for x in (q, k, v)]
        o = F.scaled_dot_product_attention(*part, is_causal=True, scale=scaling, enable_gqa=q.shape[1] != k.shape[1])
        out.append(o.transpose(1, 2).reshape(size, q.shape[1], q.shape[2]))
        at += size
    return torch.cat(out).index_select(0, spans.scatter).unsqueeze(0)


def register() -> None:
    """Makes PACKED a name transformers' models accept for their attention (idempotent)."""
    from transformers import AttentionInterface

    AttentionInterface.register(PACKED, packed_attention)

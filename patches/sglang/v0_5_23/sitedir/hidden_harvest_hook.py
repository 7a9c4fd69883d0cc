"""Per-request hidden-state dump for SGLang 0.5.23, keyed by request id.

Wraps ``LogitsProcessor.forward`` (srt/layers/logits_processor.py). At its entry, for an extend
(prefill) batch, ``hidden_states`` is the final-norm output [T_batch, H] and ``aux_hidden_states``
holds the residual stream after each layer chosen by ``--return-aux-hidden-state-layer-ids``;
rows are packed in batch order and map to requests through ``forward_batch.rids`` and
``extend_seq_lens_cpu``. Pruning to the last token happens later inside that function, so the
entry sees every row. For each request whose rid starts with HIDDEN_HARVEST_RID_PREFIX the hook
writes one file ``<rid>.hhd`` into HIDDEN_HARVEST_DUMP_DIR (write, then rename: a reader never
sees a partial dump).

File layout: 8-byte little-endian header length, a JSON header, then the aux block [T, K*H] and
the final block [T, H] as raw bf16 bits. The header carries the sha256 of the input ids exactly as
the server saw them and the prefix length the server reused, so the client can prove the dump
belongs to what it sent and was not cut short by a prefix cache or chunked prefill.
"""

from __future__ import annotations

import hashlib
import importlib.abc
import importlib.util
import importlib.metadata
import json
import logging
import os
import struct
import sys

PINNED_SGLANG_VERSION = "0.5.23"
_TARGET_MODULE = "sglang.srt.layers.logits_processor"

logger = logging.getLogger("hidden_harvest_hook")


def _check_version() -> None:
    found = importlib.metadata.version("sglang")
    if found != PINNED_SGLANG_VERSION:
        raise RuntimeError(
            f"hidden-harvest's SGLang hook is pinned to sglang=={PINNED_SGLANG_VERSION}, found {found}; "
            "install the pinned version (make install) or port patches/sglang/ to the new version"
        )


def _tp_rank() -> int:
    # With DP attention each attention-TP group holds different requests; rank 0 of each writes.
    try:
        from sglang.srt.runtime_context import get_parallel

        par = get_parallel()
        for name in ("attn_tp_rank", "tp_rank"):
            try:
                return int(getattr(par, name))
            except (AttributeError, RuntimeError, ValueError):
                continue
    except ImportError:
        pass
    return 0


def _bf16_bytes(t) -> bytes:
    import torch

    t = t.detach()
    if t.dtype != torch.bfloat16:
        t = t.to(torch.bfloat16)
    return t.to("cpu").contiguous().view(torch.int16).numpy().tobytes()


def _write_dump(dump_dir: str, rid: str, header: dict, blocks: list[bytes]) -> None:
    head = json.dumps(header).encode()
    tmp = os.path.join(dump_dir, f".{rid}.tmp")
    with open(tmp, "wb") as f:
        f.write(struct.pack("<Q", len(head)))
        f.write(head)
        for block in blocks:
            f.write(block)
    os.replace(tmp, os.path.join(dump_dir, f"{rid}.hhd"))


def dump_batch(input_ids, hidden_states, aux_hidden_states, forward_batch, dump_dir: str, prefix: str) -> None:
    import torch
    from sglang.srt.layers.aux_hidden_states import pack_aux_hidden_states

    rids = forward_batch.rids or []
    if not any(r.startswith(prefix) for r in rids):
        return
    aux = pack_aux_hidden_states(aux_hidden_states)
    seq_lens = forward_batch.extend_seq_lens_cpu
    prefix_lens = forward_batch.extend_prefix_lens_cpu or [0] * len(rids)
    # Slice by the summed sequence lengths, never by tensor length: GPU graphs may pad rows.
    start = 0
    for rid, n, prefix_len in zip(rids, seq_lens, prefix_lens):
        end = start + n
        if rid.startswith(prefix):
            ids = input_ids[start:end].to("cpu", torch.int32).numpy()
            header = {
                "rid": rid,
                "num_tokens": int(n),
                "prefix_len": int(prefix_len),
                "ids_sha256": hashlib.sha256(ids.tobytes()).hexdigest(),
                "aux_shape": [int(n), int(aux.shape[-1])],
                "last_shape": [int(n), int(hidden_states.shape[-1])],
                "source_dtype": str(aux.dtype),
            }
            _write_dump(dump_dir, rid, header, [_bf16_bytes(aux[start:end]), _bf16_bytes(hidden_states[start:end])])
        start = end


def _patch(module) -> None:
    _check_version()
    dump_dir = os.environ["HIDDEN_HARVEST_DUMP_DIR"]
    prefix = os.environ.get("HIDDEN_HARVEST_RID_PREFIX", "hh-")
    cls = module.LogitsProcessor
    original = cls.forward
    if getattr(original, "_hidden_harvest", False):
        return
    from sglang.srt.model_executor.forward_batch_info import ForwardBatch

    def forward(self, input_ids, hidden_states, lm_head, logits_metadata, aux_hidden_states=None, *args, **kwargs):
        if (
            isinstance(logits_metadata, ForwardBatch)
            and aux_hidden_states is not None
            and logits_metadata.forward_mode.is_extend()
            and _tp_rank() == 0
        ):
            dump_batch(input_ids, hidden_states, aux_hidden_states, logits_metadata, dump_dir, prefix)
        return original(self, input_ids, hidden_states, lm_head, logits_metadata, aux_hidden_states, *args, **kwargs)

    forward._hidden_harvest = True
    cls.forward = forward
    logger.info("hidden-harvest hook installed on %s.LogitsProcessor.forward, dumping to %s", _TARGET_MODULE, dump_dir)


class _PatchAfterImport(importlib.abc.MetaPathFinder):
    """Patches the target module right after it is first imported, in whichever process imports it."""

    def find_spec(self, fullname, path, target=None):
        if fullname != _TARGET_MODULE:
            return None
        sys.meta_path.remove(self)
        try:
            spec = importlib.util.find_spec(fullname)
        finally:
            sys.meta_path.insert(0, self)
        if spec is None or spec.loader is None:
            return spec
        exec_module = spec.loader.exec_module

        def exec_and_patch(module):
            exec_module(module)
            _patch(module)

        spec.loader.exec_module = exec_and_patch
        return spec


def install_import_hook() -> None:
    if not any(isinstance(f, _PatchAfterImport) for f in sys.meta_path):
        sys.meta_path.insert(0, _PatchAfterImport())

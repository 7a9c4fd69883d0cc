"""Whether the hf engine's forwards run packed (engine.packing): asked for, allowed by the model's attention,
and checked at start against padded forwards of the same sequences (actors/hf/packing.py).

A packed forward's states differ from a padded one's by kernel rounding (bf16, other matmul shapes, another
attention kernel), as a padded row's differ between batches. The check allows the larger of
PACKED_TOLERANCE and CHECK_NOISE_FACTOR times what batching alone moves the same sequences; a packed forward
that lets sequences see each other is off by far more (tests/unit/actors/test_packing.py).
"""

from __future__ import annotations

import logging

import numpy as np

from actors.hf.outputs import request_starts

logger = logging.getLogger(__name__)

PACKED_TOLERANCE = 0.05  # relative L2 per sequence and kept layer
CHECK_NOISE_FACTOR = 4
PACK_CHECK_LENGTHS = (37, 1, 100, 64)  # a single token, lengths off any tile


def choose(decoder, packing: str) -> bool:
    """Whether forwards run packed: where `packing` asks for it (auto, on), the model's attention allows it
    and a packed forward of a few sequences gives each the states its padded row gives. Run on the caller's
    thread after the decoder's load, before the engine's worker starts."""
    if packing == "off":
        return False
    refused = decoder.pack()  # by the model's config: windows, soft-capping, sinks, MLA
    why = refused or check(decoder)
    if why is None:
        logger.info("hf engine: packed forwards (no padding)")
        return True
    if decoder.attn_implementation == "sdpa":
        decoder.base.set_attn_implementation("sdpa")
    if packing == "on":
        raise RuntimeError(f"engine.packing=on: {decoder.model_dir} cannot run packed forwards: {why}")
    # A family known not to pack is what auto (CUDA's default) expects; a failed check is not.
    (logger.info if refused else logger.warning)(
        "hf engine: padded forwards: %s cannot run packed: %s", decoder.model_dir, why
    )
    return False


def kept(decoder, seqs: list[list[int]], packed: bool = False) -> list[list]:
    """One forward of `seqs` (padded rows: longest first); each sequence's kept states, float, per layer."""
    order = sorted(range(len(seqs)), key=lambda i: -len(seqs[i])) if not packed else list(range(len(seqs)))
    decoder.forward([seqs[i] for i in order], keep=True, packed=packed)
    aux, last = decoder.outputs()
    layers = [x.float() for x in [*aux, last]]
    starts = request_starts([len(seqs[i]) for i in order], layers[0].shape[:2], packed)
    flat = [x.reshape(-1, x.shape[-1]) for x in layers]
    out: list[list] = [[] for _ in seqs]
    for pos, i in enumerate(order):
        out[i] = [x[int(starts[pos]) : int(starts[pos]) + len(seqs[i])] for x in flat]
    return out


def check(decoder) -> str | None:
    """None where a packed forward's kept states match the padded forward's for every sequence and layer
    (within PACKED_TOLERANCE or CHECK_NOISE_FACTOR times batching's own noise), else what differed."""
    import torch

    def distance(a: list, b: list) -> float:
        ds = [float(torch.linalg.vector_norm(x - y) / (torch.linalg.vector_norm(y) + 1e-6)) for x, y in zip(a, b)]
        return max(ds, key=lambda d: np.inf if d != d else d)  # NaN counts as the worst

    gen = np.random.default_rng(0)
    seqs = [gen.integers(0, decoder.vocab_size, n).tolist() for n in PACK_CHECK_LENGTHS]
    try:
        padded = kept(decoder, seqs)
        noise = max(distance(kept(decoder, [s])[0], want) for s, want in zip(seqs, padded))
    except Exception as e:  # noqa: BLE001 - the padded forward is the engine's own; let start() say so
        decoder.discard()
        raise RuntimeError(f"hf engine: a padded forward failed at start: {e}") from e
    try:
        packed = kept(decoder, seqs, packed=True)
    except Exception as e:  # noqa: BLE001 - anything the packed path cannot run means padded forwards
        decoder.discard()
        return f"{type(e).__name__}: {e}"
    diff = max(distance(got, want) for got, want in zip(packed, padded))
    allowed = max(PACKED_TOLERANCE, CHECK_NOISE_FACTOR * noise)
    if diff <= allowed:
        return None
    return (
        f"a packed forward's states differ from the padded forward's by {diff:.3g} (relative L2), more than "
        f"the {allowed:.3g} allowed (batching alone moves them by {noise:.3g})"
    )

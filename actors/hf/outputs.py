"""What becomes of a forward's outputs in the hf engine: captured, or discarded.

`CaptureOutputs` (the engine's, and the job's): the decoder's hooks keep each forward's aux layers and final
state, `stage` lays every request's states out as the codec's byte planes on the device (actors/hf/staging.py)
and `resolve` turns the planes, once on the host, into one Capture per request with the header a SGLang dump
carries (actors/dump.py). `DiscardOutputs` (the benchmarks' baseline, bench/bare_hf.py): the hooks keep
nothing, nothing is staged or copied, and each request resolves without a capture once its forward has run;
what a job costs beyond it is what capturing, validating, encoding and committing cost.

Either runs in the same engine (actors/hf/engine.py, `outputs=`), so both share its batching, its threads and
its device clock.
"""

from __future__ import annotations

import hashlib
import time
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from actors.dump import Capture, CaptureHeader
from actors.engine import RequestResult
from actors.hf.staging import packed_starts, padded_starts, plane_offsets


@dataclass
class Request:
    key: str
    ids: list[int]
    future: Future
    submitted: float
    order: float = 0.0  # requests of one caller batch share it; lower goes first


@dataclass
class Staged:
    """One forward's capture on its way to the host: every request's byte planes in one uint8 buffer
    (`offsets[i]:offsets[i + 1]` is request i's), the non-finite count per padded position, and the widths
    (K*H, H). On CUDA `planes` and `nonfinite` are device tensors until the finisher has copied them; with
    nothing staged (DiscardOutputs) they stay None."""

    batch: list[Request]
    ids: np.ndarray  # the ids the forward ran: [B, T] padded rows or [1, N] packed
    starts: np.ndarray | None = None  # request i's first position in ids.reshape(-1) (None: nothing staged)
    planes: object = None
    offsets: np.ndarray | None = None
    nonfinite: object = None
    widths: tuple[int, int] = (0, 0)


def ids_sha256(ids: np.ndarray) -> str:
    # The same digest the SGLang hook publishes: sha256 over the int32 ids the forward really ran.
    return hashlib.sha256(np.ascontiguousarray(ids, dtype=np.int32).tobytes()).hexdigest()


def request_starts(lengths: list[int], shape: tuple[int, ...], packed: bool) -> np.ndarray:
    """Each request's first position in a forward's [B*T] positions: end to end when packed, else row * T."""
    return packed_starts(lengths) if packed else padded_starts(shape[0], shape[1])


class Outputs(Protocol):
    # Whether the decoder's hooks keep a forward's outputs for `stage`.
    keeps: bool

    def stage(self, batch: list[Request], ids: np.ndarray, packed: bool, stager) -> Staged:
        """Called on the forward thread right after the forward's launch; launches device work only."""

    def resolve(self, staged: Staged) -> None:
        """Sets every request's future (planes and counts on the host by then)."""


class CaptureOutputs:
    keeps = True

    def __init__(self, decoder, capture_layout: str, final_layer: str, dtype: str, cuda: bool):
        self.decoder = decoder
        self.capture_layout = capture_layout
        self.final_layer = final_layer
        self.dtype = dtype
        self.cuda = cuda

    def stage(self, batch: list[Request], ids: np.ndarray, packed: bool, stager) -> Staged:
        """Byte planes [2, W, T] per request (aux, then last) in one buffer, plus the non-finite counts
        per padded position (summed per request on the host over its real positions: a device-side mask
        would need the lengths copied up, a sync point). See actors/hf/staging.py."""
        import torch

        aux, last = self.decoder.outputs()
        h = last.shape[-1]
        lengths = [len(r.ids) for r in batch]
        starts = request_starts(lengths, ids.shape, packed)
        offsets = plane_offsets(lengths, len(aux) + 1, h, self.capture_layout)
        planes = torch.empty(int(offsets[-1]), dtype=torch.uint8, device=last.device)
        bad = torch.zeros(last.shape[:2], dtype=torch.int32, device=last.device)
        stager([*aux, last], lengths, starts, offsets, planes, bad)
        staged = Staged(batch, ids, starts, planes, offsets, bad, (len(aux) * h, h))
        del aux, last
        if not self.cuda:
            staged.planes, staged.nonfinite = planes.numpy(), bad.numpy()
        # On CUDA the finisher allocates the pinned memory and queues the copy: allocating pinned memory can
        # take a while, and this thread only launches device work. The staging tensors stay referenced (in
        # `staged`) until the finisher has seen the copy end.
        return staged

    def resolve(self, staged: Staged) -> None:
        w, h = staged.widths
        now = time.monotonic()
        starts, ids, nonfinite = staged.starts, staged.ids.reshape(-1), staged.nonfinite.reshape(-1)
        for row, r in enumerate(staged.batch):
            n, a = len(r.ids), int(starts[row])
            header = CaptureHeader(
                rid=r.key,
                num_tokens=n,
                prefix_len=0,
                ids_sha256=ids_sha256(ids[a : a + n]),
                nonfinite=int(nonfinite[a : a + n].sum()),
                aux_shape=(n, w),
                last_shape=(n, h),
                source_dtype=self.dtype,
                final_layer=self.final_layer,
                layout=self.capture_layout,
            )
            cap = Capture(header, None, 0, body=staged.planes[staged.offsets[row] : staged.offsets[row + 1]])
            r.future.set_result(RequestResult(r.key, cap, None, now - r.submitted, r.key))


class DiscardOutputs:
    keeps = False

    def stage(self, batch: list[Request], ids: np.ndarray, packed: bool, stager) -> Staged:
        return Staged(batch, ids)

    def resolve(self, staged: Staged) -> None:
        now = time.monotonic()
        for r in staged.batch:
            r.future.set_result(RequestResult(r.key, None, None, now - r.submitted))


OUTPUTS = ("capture", "discard")


def outputs_for(name: str, decoder, capture_layout: str, final_layer: str, dtype: str, cuda: bool) -> Outputs:
    """The engine's `outputs=` argument as its strategy."""
    if name == "capture":
        return CaptureOutputs(decoder, capture_layout, final_layer, dtype, cuda)
    if name == "discard":
        return DiscardOutputs()
    raise ValueError(f"outputs {name!r}: one of {', '.join(OUTPUTS)}")

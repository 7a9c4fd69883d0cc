"""Pinned host buffers for the hf engine's device-to-host copies, allocated once and lent out batch by batch.

Allocating page-locked memory (cudaHostAlloc behind `torch.empty(..., pin_memory=True)`) takes a lock in the
CUDA driver that the forward thread's kernel launches also need, and pins every page of the buffer while
holding it, which for one batch's capture takes a while. Done on the finisher thread while the next forward
is being launched, that time lands inside the forward as device idle
(bench/results/longtail_adaptive_floor_h200.json). torch's own pinned cache reuses blocks only within a
power-of-two size class, and a batch's block stays taken until the actor has encoded every request in it, so
a job of varied batch sizes keeps allocating.

`PinnedSlabs` holds a few buffers of the largest batch's size. `take(n)` lends the first n bytes of a free one,
as a tensor (for the copy) and a numpy array over the same memory (for the captures); the buffer comes back
when that array and every numpy view of it are gone (the captures released after encoding). The tensor is
the copy's alone: drop it once the copy is done. A buffer is only allocated when none is free and fewer than
`limit` exist; past that, or for a request larger than a buffer, `take` returns None and the caller allocates
its own, so a slow consumer costs allocations, never a stall or unbounded pinned memory.
"""

from __future__ import annotations

import threading
import time
import weakref
from collections.abc import Callable


def _pinned(nbytes: int):
    import torch

    return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)


class PinnedSlabs:
    def __init__(self, slab_bytes: int, limit: int, alloc: Callable[[int], object] = _pinned):
        if slab_bytes <= 0 or limit <= 0:
            raise ValueError(f"slab_bytes and limit must be positive, got {slab_bytes} and {limit}")
        self.slab_bytes = slab_bytes
        self.limit = limit
        self._alloc = alloc
        self._free: list = []
        self._count = 0
        self._lock = threading.Lock()
        self.alloc_s = 0.0  # seconds spent allocating slabs (each one once)
        self.misses = 0  # takes that found no slab: the caller allocated for itself

    @property
    def allocated(self) -> int:
        return self._count

    def reserve(self, n: int) -> PinnedSlabs:
        """Allocate up to n slabs now (at engine start), so that a run's first batches do not."""
        while self._count < min(n, self.limit):
            slab = self._new()
            with self._lock:
                self._free.append(slab)
        return self

    def _new(self):
        t0 = time.monotonic()
        slab = self._alloc(self.slab_bytes)
        self.alloc_s += time.monotonic() - t0
        with self._lock:
            self._count += 1
        return slab

    def take(self, nbytes: int):
        """(tensor, array) over the first `nbytes` of a free slab, or None (too large, or every slab is lent)."""
        if nbytes > self.slab_bytes:
            self.misses += 1
            return None
        with self._lock:
            slab = self._free.pop() if self._free else None
            grow = slab is None and self._count < self.limit
        if slab is None:
            if not grow:
                self.misses += 1
                return None
            slab = self._new()
        tensor = slab[:nbytes]
        # numpy views of `array` keep `array` itself as their base (its memory is the tensor's), so its death
        # is the last view's; a tensor's Python object is no such owner (numpy() wraps a new one).
        array = tensor.numpy()
        weakref.finalize(array, self._give_back, slab)
        return tensor, array

    def _give_back(self, slab) -> None:
        with self._lock:
            self._free.append(slab)

"""The hf engine's finisher on CUDA: each forward's staged capture copied to pinned host memory on a side
stream, then its requests resolved, while the forward thread already launches the next forward.

The forward thread hands a batch over with `put`, which blocks while the previous batch still waits for its
copy: at most two batches are in flight, which bounds device and pinned memory. The pinned buffers come from
`PinnedSlabs` (actors/hf/pinned.py), all of them allocated at the first copy (the engine's warm-up), where the
time costs no forward: one grown mid-run holds the driver's lock the forward thread's launches need
(bench/results/longtail_adaptive_floor_h200.json).
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable

import numpy as np

from actors.engine import RequestResult
from actors.hf.outputs import Staged
from actors.hf.pinned import PinnedSlabs
from actors.hf.staging import body_per_token


class HostCopier:
    """`observe(marks, staged)` reads a batch's device clock once its copy is done; `resolve(staged)` then
    sets its futures from the host copy. `timing` is the engine's dict of seconds (pin_alloc, copy_wait,
    resolve)."""

    def __init__(
        self,
        timing: dict,
        max_batch_tokens: int,
        capture_layout: str,
        slab_limit: int,
        observe: Callable[[dict, Staged], None],
        resolve: Callable[[Staged], None],
    ):
        self.timing = timing
        self.max_batch_tokens = max_batch_tokens
        self.capture_layout = capture_layout
        self.slab_limit = slab_limit
        self.slabs: PinnedSlabs | None = None  # made at the first copy
        self._observe = observe
        self._resolve = resolve
        self._done: queue.Queue = queue.Queue(maxsize=1)  # batches whose copy is in flight
        self._thread: threading.Thread | None = None
        self._stream = None

    def start(self) -> None:
        import torch

        self._stream = torch.cuda.Stream()
        self._thread = threading.Thread(target=self._loop, name="hf-engine-finish", daemon=True)
        self._thread.start()

    def close(self) -> None:
        if self._thread is not None:
            self._done.put(None)
            self._thread.join(timeout=60)
            self._thread = None

    def put(self, staged: Staged, marks: dict) -> None:
        """Hands over one batch: its staging and the device clock's marks, `marks["end"]` the staging's end."""
        self._done.put((staged, marks))

    def reset(self) -> None:
        if self.slabs is not None:
            self.slabs.misses = 0

    def _loop(self) -> None:
        import torch

        torch.cuda.set_device(self._stream.device)  # this thread's pinned allocations and events
        while True:
            item = self._done.get()
            if item is None:
                return
            staged, marks = item
            try:
                done = marks["end"]
                if staged.planes is not None:  # a capture (DiscardOutputs stages nothing)
                    host, counts, done = self._copy(staged.planes, staged.nonfinite, marks["end"], staged.widths, marks)
                t0 = time.monotonic()
                done.synchronize()
                t1 = time.monotonic()
                self.timing["copy_wait"] += t1 - t0
                self._observe(marks, staged)
                if staged.planes is not None:
                    # Copied: the device memory may go back to the pool.
                    staged.planes, staged.nonfinite = host, counts
                    host = counts = None  # the captures alone hold the pinned memory, which goes back with them
                self._resolve(staged)
                self.timing["resolve"] += time.monotonic() - t1
            except Exception as e:  # noqa: BLE001
                for r in staged.batch:
                    if not r.future.done():
                        r.future.set_result(RequestResult(r.key, None, f"copy failed: {type(e).__name__}: {e}", 0.0))

    def _copy(self, staging, bad, end, widths: tuple[int, int], marks: dict | None = None):
        """Queue one batch's device-to-host copy behind its staging (the event `end`): (host, counts, done).
        `marks` gets when the pinned allocation began and how long it took (the forward log's)."""
        import torch

        t0, unix = time.monotonic(), time.time()
        nbytes = staging.numel()
        at = -(-nbytes // 8) * 8  # the counts after the planes, aligned for their int32
        slabs = self._pinned_slabs(widths)
        lent = slabs.take(at + bad.numel() * bad.element_size()) if slabs is not None else None
        if lent is not None:  # one buffer, allocated once: the planes, then the counts
            buffer, array = lent
            host, host_np = buffer[:nbytes], array[:nbytes]
            counts = buffer[at : at + bad.numel() * bad.element_size()].view(bad.dtype).view(bad.shape)
            counts_np = array[at : at + counts.numel() * counts.element_size()].view(np.int32).reshape(bad.shape)
            del buffer
        else:  # larger than a slab, or every slab still lent: allocated for this batch alone
            host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
            counts = torch.empty(bad.shape, dtype=bad.dtype, pin_memory=True)
            host_np, counts_np = host.numpy(), counts.numpy()
        took = time.monotonic() - t0
        self.timing["pin_alloc"] += took
        if marks is not None:
            marks.update(pin_alloc_unix=unix, pin_alloc_s=took)
        with torch.cuda.stream(self._stream):
            self._stream.wait_event(end)
            host.copy_(staging, non_blocking=True)
            counts.copy_(bad, non_blocking=True)
            done = torch.cuda.Event()
            done.record()
        return host_np, counts_np, done

    def _pinned_slabs(self, widths: tuple[int, int]) -> PinnedSlabs | None:
        """The copies' pinned buffers, made at the first copy, which is the warm-up's forward of
        max_batch_tokens: one slab holds the largest batch's planes and counts."""
        if self.slabs is None and self.slab_limit > 0:
            w, h = widths
            # The body per token (two byte planes per value, or fp8 and a scale per layer), and an int32 count.
            per_token = body_per_token(w // h + 1, h, self.capture_layout) + 4
            self.slabs = PinnedSlabs(self.max_batch_tokens * per_token + 8, self.slab_limit).reserve(self.slab_limit)
        return self.slabs

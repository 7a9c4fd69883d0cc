"""The wall-clock timer the CPU benchmarks share (the GPU ones time on CUDA events, beside their kernels)."""

from __future__ import annotations

import time
from collections.abc import Callable


def best_wall_s(fn: Callable[[], object], repeats: int, warm_up: bool = True) -> float:
    """The least wall-clock seconds of `repeats` calls of fn: the least, since on a shared machine every other
    figure carries whatever else ran. With warm_up, one call first that is not counted (allocations, the
    kernel's choice, caches)."""
    if warm_up:
        fn()
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best

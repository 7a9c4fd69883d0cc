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


def machine_gflops(seconds: float = 3.0, size: int = 1024) -> float:
    """What the machine's cores do right now: float32 matmul GFLOP/s over `seconds`, on torch's threads.

    A shared host's speed drifts by more than a benchmark's margin: on a 2-core cloud host this probe read
    95.9 to 182.9 GFLOP/s within one run, each time with nothing else running
    (bench/results/throughput_cpu_short_probed_avx2.json). Taken before and after each phase of a CPU
    benchmark, it says whether a ratio between phases was the job's or the machine's."""
    import torch  # only the CPU benchmarks that probe need it

    a, b = torch.randn(size, size), torch.randn(size, size)
    a @ b  # the kernel's choice and the first touch of its buffers, not counted
    t0, n = time.perf_counter(), 0
    while time.perf_counter() - t0 < seconds:
        a @ b
        n += 1
    return round(2 * size**3 * n / (time.perf_counter() - t0) / 1e9, 1)

"""What this CPU computes natively, for the engines' choice of dtype and kernels."""

from __future__ import annotations


def cpu_has_bf16_matmul(cpuinfo: str | None = None) -> bool | None:
    """Whether this CPU multiplies bf16 natively (x86 avx512_bf16 or amx_bf16; arm bf16); None: cannot tell.

    Without it torch's bf16 matmul converts on the fly, several times slower than float32
    (bench/results/request_path_cpu.json)."""
    if cpuinfo is None:
        try:
            with open("/proc/cpuinfo") as f:
                cpuinfo = f.read()
        except OSError:
            return None
    for line in cpuinfo.splitlines():
        key, sep, value = line.partition(":")
        if sep and key.strip() in ("flags", "Features"):
            flags = set(value.split())
            return bool(flags & {"avx512_bf16", "amx_bf16", "bf16"})
    return None

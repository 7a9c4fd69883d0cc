"""bf16 matrix products computed as float32 products rounded to bf16, for a CPU without native bf16 matmul.

A native bf16 matmul (AMX, avx512_bf16, oneDNN) reads bf16 operands, accumulates in float32 and rounds the
result to bf16 once. Where the CPU has no such instruction torch's bf16 matmul does the same arithmetic in a
generic loop, several times slower than a float32 matmul of the same shape. Widening bf16 operands to float32
is exact, so the float32 product rounded to bf16 is the same computation up to the order of the float32 sums
(a rare element one bf16 step off torch's). Forwards of the default model take far less time this way, and
each layer's distance from the float32 forward stays what it was, which is what a bf16 forward is used for
here: the audit's yardstick (pipeline/tools/fidelity.py). `python bench/probes/bench_bf16_gemms_cpu.py`,
bench/results/bf16_gemms_cpu.json.

Attention kernels (sdpa) are left as torch runs them: their bf16 path is fast on any CPU and has rounding of
its own that the yardstick should keep. Eager attention's matmuls are products like any other.
"""

from __future__ import annotations

import contextlib
import functools


@functools.cache
def _mode_class():
    import torch
    import torch.nn.functional as F
    from torch.overrides import TorchFunctionMode

    # The products a decoder's forward runs: its linear layers (MoE experts' too), eager attention's
    # matmuls and the fused multiply-adds some layers use.
    gemms = {
        F.linear,
        torch.matmul,
        torch.Tensor.matmul,
        torch.Tensor.__matmul__,
        torch.mm,
        torch.Tensor.mm,
        torch.bmm,
        torch.Tensor.bmm,
        torch.addmm,
        torch.baddbmm,
    }
    bf16 = torch.bfloat16

    def widen(x):
        return x.float() if isinstance(x, torch.Tensor) and x.dtype == bf16 else x

    class Float32Gemms(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            # The mode is off inside this method, so the calls below run as torch's own.
            if func in gemms:
                tensors = [a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)]
                # Only all-bf16 products on the CPU: a mixed one keeps torch's own answer (an error, or its
                # promotion), and a product on another device is that device's.
                if tensors and all(t.dtype == bf16 and t.device.type == "cpu" for t in tensors):
                    out = func(*map(widen, args), **{k: widen(v) for k, v in kwargs.items()})
                    return out.to(bf16)
            return func(*args, **kwargs)

    return Float32Gemms


def needed(device: str, dtype: str) -> bool:
    """Whether bf16 forwards on `device` should run their products in float32 (a CPU without native bf16)."""
    from actors.cpu import cpu_has_bf16_matmul

    return str(device) == "cpu" and dtype == "bfloat16" and cpu_has_bf16_matmul() is False


def float32_gemms(on: bool = True):
    """A context in which bf16 matrix products on this thread run as float32 products rounded to bf16."""
    return _mode_class()() if on else contextlib.nullcontext()

"""CPU stand-in for ``sgl_kernel`` (no CPU build of it exists on PyPI).

SGLang 0.5.23 imports a handful of names from ``sgl_kernel`` at import time. On the CPU path only
``assign_req_to_token_pool_cpu`` is called; it gets a pure-torch version here. Every other name
resolves to a function that raises on call, so a code path we did not expect fails loudly instead
of computing something wrong. Because ``sgl_kernel.common_ops`` has no ``amx`` kernels here,
SGLang's AMX check is false and layers take their ``forward_native`` torch paths.
"""

from __future__ import annotations

import torch

__version__ = "0.0.0+hidden-harvest-cpu-standin"


def assign_req_to_token_pool_cpu(
    req_pool_indices: torch.Tensor,
    req_to_token: torch.Tensor,
    start_offset: torch.Tensor,
    end_offset: torch.Tensor,
    out_cache_loc: torch.Tensor,
    pool_len: int,
) -> None:
    # out_cache_loc holds the new KV slots of all requests back to back, in batch order.
    offset = 0
    for pool_idx, start, end in zip(req_pool_indices.tolist(), start_offset.tolist(), end_offset.tolist()):
        n = end - start
        req_to_token[pool_idx, start:end] = out_cache_loc[offset : offset + n].to(req_to_token.dtype)
        offset += n


def _missing(name: str):
    def _raise(*args, **kwargs):
        raise NotImplementedError(
            f"sgl_kernel.{name} is not available in the hidden-harvest CPU stand-in; "
            "this SGLang code path needs the real CUDA kernel package"
        )

    _raise.__name__ = name
    return _raise


def __getattr__(name: str):
    if name.startswith("__"):
        raise AttributeError(name)
    return _missing(name)

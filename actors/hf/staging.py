"""Staging: a forward's captured states laid out as each request's codec byte planes, on the device.

A forward's states are, per captured layer, a tensor [B, T, H] in bf16: B padded rows of T positions, or one
packed row of the requests end to end (actors/hf/packing.py). Either way request i's n_i tokens are the
positions starts[i] .. starts[i] + n_i of the rows read as one [B*T, H] run (padded: starts[i] = i*T). What the
host needs is, per request, one contiguous body: the aux planes [2, K*H, n] (low bytes of every channel, then
the high bytes; aux layer k holds channels k*H .. (k+1)*H), then the final layer's planes [2, H, n] (the
layout of `pipeline.format.codec.to_planes`, which a SGLang dump also carries). Alongside it, per position
([B, T] int32), how many of its values are not finite; the host sums those over each request's tokens.

Two implementations with the same output:
- `stage_torch`: torch ops, on any device. One transpose per layer, then one copy per request and layer:
  a few hundred small ops per forward, each a Python call into torch that lets go of the interpreter lock
  and waits to take it back; in a job, where encoding threads and Ray's own threads want the same lock,
  that holds up the thread that launches the forwards.
- `TritonStager`: one Triton kernel launch per layer, CUDA only. Each program reads a tile of one row's
  states, writes both byte planes transposed straight into the request's place in the staging buffer and
  counts the non-finite values (a bf16 value is not finite when its exponent bits are all ones); padded
  positions are never read. `TritonStager.checked` runs it against `stage_torch` once on a small batch
  with odd lengths and non-finite values and gives None (and logs why) where Triton is missing, does not
  compile or does not match, so the engine falls back to the torch ops.

What each costs, device and host: bench/results/stage_gpu.json and job_h200.json.
"""

from __future__ import annotations

import contextlib
import logging

import numpy as np

logger = logging.getLogger(__name__)


def body_per_token(layers: int, hidden: int, layout: str = "planes") -> int:
    """Bytes of a request's body per token: 2 per value (planes), or a float32 scale per layer and 1 per value (fp8)."""
    return 2 * layers * hidden if layout == "planes" else layers * (4 + hidden)


def padded_starts(rows: int, length: int) -> np.ndarray:
    """Request i's first position in a padded forward's [B*T] positions: i*T."""
    return np.arange(rows, dtype=np.int64) * length


def packed_starts(lengths: list[int]) -> np.ndarray:
    """Request i's first position in a packed forward's [N] positions: the lengths before it."""
    return np.concatenate([[0], np.cumsum(lengths[:-1])]).astype(np.int64)


def plane_offsets(lengths: list[int], layers: int, hidden: int, layout: str = "planes") -> np.ndarray:
    """Where each request's body starts in the staging buffer, and its end ([B + 1], int64)."""
    per_token = body_per_token(layers, hidden, layout)
    return np.concatenate([[0], np.cumsum([per_token * n for n in lengths])]).astype(np.int64)


FP8_MAX = 448.0  # the largest finite float8_e4m3fn


def fp8_scale_torch(amax):
    """`pipeline.format.codec.fp8_scale` in torch: amax / 448 rounded up to a bf16 value (1 where amax is 0)."""
    import torch

    s = (amax / FP8_MAX).contiguous()
    u = s.view(torch.int32)
    up = torch.where((u & 0xFFFF) != 0, (u + 0x10000) & -0x10000, u).view(torch.float32)
    return torch.where(amax > 0, up, torch.ones_like(up))


def stage_fp8(layers, lengths: list[int], starts: np.ndarray, offsets: np.ndarray, staging, bad) -> None:
    """`stage_torch` for an fp8 output: each request's body is the codec's fp8 layout (pipeline/format/codec.py):
    the aux column's float32 scales [K, n] and e4m3 values [K*H, n], then the final layer's scales [1, n] and
    values [H, n]; one scale per token per layer (amax / 448 rounded up to a bf16 value, as
    `pipeline.format.codec.fp8_scale`; 1 for an all-zero row). The quantization runs
    on the states' device, over every position a layer at a time; padded positions are never copied."""
    import torch

    *aux, last = layers
    h, k = last.shape[-1], len(aux)
    counts = bad.view(-1)
    for states in layers:
        counts += (~torch.isfinite(states.reshape(-1, h))).sum(-1, dtype=torch.int32)
    for li, states in enumerate(layers):
        flat = states.reshape(-1, h)
        amax = flat.abs().amax(-1).float()  # [P]; exact in bf16
        scale = fp8_scale_torch(amax)
        # In float32, as the codec's reference (a bf16 quotient would round twice). Clamped: torch's cast to
        # e4m3fn does not saturate (an infinite input would become NaN).
        x = flat.float() / scale.unsqueeze(-1)
        q = x.clamp_(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).view(torch.uint8)
        channels = q.t().contiguous()  # [H, P]: each request's values are then whole rows
        scale_bytes = scale.contiguous().view(torch.uint8).view(-1, 4)  # float32 as its 4 bytes
        del x, q
        for i, n in enumerate(lengths):
            o, a = int(offsets[i]), int(starts[i])
            if li < k:  # aux: scales [K, n] (as bytes [K, 4n]), then values [K*H, n]; layer li is row li / rows li*H..
                scales, values = (
                    staging[o : o + 4 * k * n].view(k, 4 * n)[li],
                    staging[o + 4 * k * n : o + (4 + h) * k * n],
                )
                values = values.view(k * h, n)[li * h : (li + 1) * h]
            else:
                at = o + (4 + h) * k * n
                scales, values = staging[at : at + 4 * n], staging[at + 4 * n : at + (4 + h) * n].view(h, n)
            scales.copy_(scale_bytes[a : a + n].reshape(-1))
            values.copy_(channels[:, a : a + n])
        del channels, scale, scale_bytes


def stage_torch(layers, lengths: list[int], starts: np.ndarray, offsets: np.ndarray, staging, bad) -> None:
    """Fills `staging` (uint8, offsets[-1] bytes) with every request's planes and adds each position's
    non-finite count over `layers` (aux..., last; each [B, T, H] bf16) into `bad` (int32 [B, T]); request i
    is positions starts[i] .. starts[i] + lengths[i] of the [B*T] run."""
    import torch

    *aux, last = layers
    h = last.shape[-1]
    w = len(aux) * h
    counts = bad.view(-1)
    for states in layers:
        counts += (~torch.isfinite(states.reshape(-1, h))).sum(-1, dtype=torch.int32)
    for k, states in enumerate(layers):
        # One transpose per layer for every position, [B*T, H] -> [H, B*T] as int16 (the bf16 bits), so each
        # request's planes are then a copy of whole rows, and one layer's copy alive at a time (faster than
        # splitting bytes token by token: bench/results/stage_gpu.json).
        channels = states.reshape(-1, h).view(torch.int16).t().contiguous()
        for i, n in enumerate(lengths):
            o, a = int(offsets[i]), int(starts[i])
            if k < len(aux):  # aux planes [2, W, n]: layer k holds channels k*H .. (k+1)*H
                planes = staging[o : o + 2 * n * w].view(2, w, n)[:, k * h : (k + 1) * h]
            else:
                planes = staging[o + 2 * n * w : int(offsets[i + 1])].view(2, h, n)
            # int16 [H, n] read as its bytes [H, n, 2] (low byte first) -> planes [2, H, n]
            planes.copy_(channels[:, a : a + n].unsqueeze(-1).view(torch.uint8).permute(2, 0, 1))
        del channels


_kernel = None


def _build_kernel():
    """The Triton kernel, defined on first use (Triton is imported only where a CUDA engine asks for it)."""
    global _kernel
    if _kernel is not None:
        return _kernel
    import triton
    import triton.language as tl

    # Sizes that change from forward to forward are not specialized on (divisibility by 16): each new
    # specialization is a compile, on the forward thread, in the middle of a job.
    @triton.jit(do_not_specialize=["stride_t", "H", "W", "col0"])
    def planes_kernel(
        src,
        stride_t,
        dst,
        meta,
        bad,
        H,
        W,
        col0,
        LAST: tl.constexpr,
        BLOCK_T: tl.constexpr,
        BLOCK_H: tl.constexpr,
    ):
        # One program: request b, its tokens t0 .. t0+BLOCK_T, channels c0 .. c0+BLOCK_H of one layer.
        b = tl.program_id(0)
        start = tl.load(meta + 3 * b)  # int64: the request's first byte in dst
        n = tl.load(meta + 3 * b + 1)  # int64: its tokens
        first = tl.load(meta + 3 * b + 2)  # int64: its first position in src's [B*T] positions
        t = tl.program_id(1) * BLOCK_T + tl.arange(0, BLOCK_T)
        c = tl.program_id(2) * BLOCK_H + tl.arange(0, BLOCK_H)
        keep = (t < n)[:, None] & (c < H)[None, :]
        pos = first + t.to(tl.int64)
        x = tl.load(src + pos[:, None] * stride_t + c[None, :], mask=keep, other=0)
        # bf16 bits as int16: not finite when the exponent bits (0x7F80) are all set.
        bad_count = tl.sum((((x & 0x7F80) == 0x7F80) & keep).to(tl.int32), axis=1)
        tl.atomic_add(bad + pos, bad_count, mask=t < n)
        if LAST:  # after the aux planes [2, W, n]: planes [2, H, n]
            base = start + 2 * n * W
            width = H
            col = c
        else:  # aux planes [2, W, n], this layer's channels from col0
            base = start
            width = W
            col = col0 + c
        at = base + col[None, :].to(tl.int64) * n + t[:, None]
        tl.store(dst + at, (x & 0xFF).to(tl.uint8), mask=keep)
        tl.store(dst + width * n + at, ((x >> 8) & 0xFF).to(tl.uint8), mask=keep)

    _kernel = planes_kernel
    return _kernel


class TritonStager:
    """`stage_torch`'s output from one kernel launch per layer (CUDA)."""

    BLOCK_T = 64
    BLOCK_H = 64

    def __init__(self):
        self.kernel = _build_kernel()

    def __call__(self, layers, lengths: list[int], starts: np.ndarray, offsets: np.ndarray, staging, bad) -> None:
        import torch

        *aux, last = layers
        h = last.shape[-1]
        w = len(aux) * h
        # (first byte, tokens, first position) per request, copied up from pinned memory behind the forward:
        # no host wait.
        meta = np.stack([offsets[:-1], np.asarray(lengths, dtype=np.int64), np.asarray(starts, dtype=np.int64)], axis=1)
        meta = torch.from_numpy(np.ascontiguousarray(meta, dtype=np.int64))
        if staging.is_cuda:
            meta = meta.pin_memory().to(staging.device, non_blocking=True)
        grid = (len(lengths), -(-max(lengths) // self.BLOCK_T), -(-h // self.BLOCK_H))
        # Triton launches on the current device, torch ops on their tensors' (an engine on cuda:1 with the
        # thread's current device 0 would hand one device's pointers to the other).
        with torch.cuda.device(staging.device) if staging.is_cuda else contextlib.nullcontext():
            for k, states in enumerate(layers):
                bits = states.view(torch.int16).reshape(-1, h)  # [B*T, H]; a copy only where rows are strided
                if bits.stride(-1) != 1:
                    bits = bits.contiguous()
                self.kernel[grid](
                    bits,
                    bits.stride(0),
                    staging,
                    meta,
                    bad,
                    h,
                    w,
                    k * h,
                    LAST=k == len(aux),
                    BLOCK_T=self.BLOCK_T,
                    BLOCK_H=self.BLOCK_H,
                )

    @classmethod
    def checked(cls, device) -> TritonStager | None:
        """A stager that matched `stage_torch` on a small batch on `device`, or None (logged) to use torch."""
        import torch

        try:
            stager = cls()
            gen = torch.Generator().manual_seed(0)
            lengths = [70, 1, 129, 64]  # tile edges, a single token, a full tile
            b, t, h, k = len(lengths), max(lengths) + 3, 96, 2  # h not a multiple of the tile
            layers = [(torch.randn(b, t, h, generator=gen) * 4).to(torch.bfloat16) for _ in range(k + 1)]
            layers[0][0, 5, 7] = float("nan")
            layers[-1][2, 128, 95] = float("inf")
            layers[1][3, 66, 0] = float("-inf")  # past the request's end: not counted, not copied
            layers = [x.to(device) for x in layers]
            offsets = plane_offsets(lengths, k + 1, h)
            # The same requests packed end to end in one row (a packed forward's layout).
            packed = [torch.cat([x[r, :n] for r, n in enumerate(lengths)])[None] for x in layers]
            for states, starts in ((layers, padded_starts(b, t)), (packed, packed_starts(lengths))):
                out = []
                for fill in (stage_torch, stager):
                    staging = torch.zeros(int(offsets[-1]), dtype=torch.uint8, device=device)
                    bad = torch.zeros(states[0].shape[:2], dtype=torch.int32, device=device).view(-1)
                    fill(states, lengths, starts, offsets, staging, bad)
                    out.append((staging.cpu(), [int(bad[a : a + n].sum()) for a, n in zip(starts, lengths)]))
                (want, want_bad), (got, got_bad) = out
                if not torch.equal(want, got) or want_bad != got_bad:
                    raise AssertionError(
                        f"bytes equal: {torch.equal(want, got)}, non-finite counts {got_bad} (want {want_bad})"
                    )
        except Exception as e:  # noqa: BLE001 - any failure means the torch staging, which is always right
            logger.warning(
                "staging with torch ops (a few hundred small ops per forward): the Triton kernel is not usable here: %s: %s",
                type(e).__name__,
                e,
            )
            return None
        return stager

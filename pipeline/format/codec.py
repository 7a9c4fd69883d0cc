"""The hidden-state codec: how one sample's [T, W] hidden tensor is stored as one binary value.

A value is a *head* stored as is, then a *tail* that the encoding may compress (zstd, level 1, content size in
the frame header, so any zstd decoder reads it). Both are channel-major ([rows, T]: a channel's tokens side
by side), the layout the engines produce on the device before the device-to-host copy (patches/,
actors/hf/staging.py), so the host only compresses and copies. W = K*H for the aux layers, H for the final
state.

`planes_zstd` / `raw` (lossless bf16): the bits as two byte planes [2, W, T]; head = plane 0 (the low bytes:
mantissa noise that no codec shrinks), tail = plane 1 (the high bytes: sign and exponent, which repeat along
a channel and compress well: bench/results/data_path_h200.json; `raw` stores it as is).

    lo = np.frombuffer(value, np.uint8, W * T)
    hi = np.frombuffer(pa.Codec("zstd").decompress(value[W * T:], W * T), np.uint8)   # raw: value[W * T:]
    bits = (hi.astype(np.uint16) << 8 | lo).reshape(W, T).T                           # [T, W] bf16 bits

`fp8` (lossy, bench/results/fp8_default_model.json): every H-wide layer block of every token is scaled apart (an aux layer and
the final layer differ in range by orders of magnitude): scale = amax / 448 rounded up to a bf16 value (float32;
1 where the block is all zero), values = e4m3fn(x / scale) from float32. Rounded up: the largest value still
lands within 448, and the scale's low two bytes are zero, so it compresses to about half. A power-of-two scale
would compress further but leaves up to one binade of e4m3's range unused, which costs accuracy on every block.
Head = nothing; tail = the scales, float32 [B, T] (B = W / H blocks), then the e4m3 bytes [W, T], one zstd
frame. Dequantized: the float32 product e4m3 * scale (exact: 4 and 8 significant bits), rounded once to bf16.

    body = pa.Codec("zstd").decompress(value, 4 * B * T + W * T)
    s = np.frombuffer(body, np.float32, B * T).reshape(B, T)
    q = np.frombuffer(body, np.uint8, W * T, offset=4 * B * T).reshape(W, T)
    x = torch.from_numpy(q.T.copy()).view(torch.float8_e4m3fn).float().view(T, B, H) * torch.from_numpy(s.T.copy())[..., None]
    states = x.view(T, W).bfloat16()

One call encodes one sample on one thread; the actor runs many at once on a thread pool (zstd and the copies
release the GIL).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pyarrow as pa

ENCODINGS = ("planes_zstd", "raw", "fp8")
FP8_MAX = 448.0  # the largest finite float8_e4m3fn


class CodecError(ValueError):
    pass


def _zstd_bound(n: int) -> int:
    """An upper bound of zstd's output for n input bytes (ZSTD_COMPRESSBOUND, rounded up generously)."""
    return n + (n >> 7) + (1 << 16)


def to_planes(bits: np.ndarray) -> np.ndarray:
    """uint16 bf16 bits [T, W] -> uint8 byte planes [2, W, T] (plane 0 low bytes)."""
    t, w = bits.shape
    return np.ascontiguousarray(
        np.ascontiguousarray(bits, dtype="<u2").view(np.uint8).reshape(t, w, 2).transpose(2, 1, 0)
    )


def from_planes(planes: np.ndarray) -> np.ndarray:
    """uint8 byte planes [2, W, T] -> uint16 bf16 bits [T, W]."""
    return np.ascontiguousarray((planes[1].astype(np.uint16) << 8 | planes[0]).T)


def _e4m3_table() -> np.ndarray:
    """float32 value of each of the 256 float8_e4m3fn bytes (0x7F and 0xFF are NaN; there is no infinity)."""
    b = np.arange(256)
    sign = np.where(b & 0x80, -1.0, 1.0)
    exp, man = (b >> 3) & 0xF, b & 0x7
    mag = np.where(exp == 0, man / 8.0 * 2.0**-6, (1 + man / 8.0) * 2.0 ** (exp - 7.0))
    mag = np.where((b & 0x7F) == 0x7F, np.nan, mag)
    return (sign * mag).astype(np.float32)


E4M3 = _e4m3_table()


def bf16_bits(x: np.ndarray) -> np.ndarray:
    """float32 -> uint16 bf16 bits, rounded to nearest even (torch's rounding; NaN stays NaN)."""
    u = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    rounded = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)
    return np.where(np.isnan(x), np.uint16(0x7FC0), rounded)


def bits_to_float(bits: np.ndarray) -> np.ndarray:
    """uint16 bf16 bits -> float32 (exact)."""
    return (np.asarray(bits, dtype=np.uint32) << 16).view(np.float32)


def fp8_scale(amax: np.ndarray) -> np.ndarray:
    """float32: amax / 448 rounded up (in magnitude) to a bf16 value; 1 where amax is 0. The engines compute
    the same in torch, on the float32 bits (actors/hf/staging.py, the SGLang hook)."""
    s = np.ascontiguousarray(np.asarray(amax, np.float32) / np.float32(FP8_MAX))
    u = s.view(np.uint32)
    up = np.where(u & 0xFFFF, (u + 0x10000) & 0xFFFF0000, u).astype(np.uint32).view(np.float32)
    return np.where(np.asarray(amax) > 0, up, np.float32(1)).astype(np.float32)


def quantize(bits: np.ndarray, block: int) -> np.ndarray:
    """uint16 bf16 bits [T, W] -> the fp8 body (head then tail, uncompressed) on the host, in numpy.

    The engines quantize on the device (same math, in torch); this is for tests, benchmarks and engines
    without a device-side step. Rounding to e4m3 is to the nearest, ties to even, like torch's cast."""
    x = bits_to_float(bits)
    t, w = x.shape
    blocks = x.reshape(t, w // block, block)
    scale = fp8_scale(np.abs(blocks).max(axis=2))
    with np.errstate(invalid="ignore"):  # an infinite block divides inf by inf: NaN, as torch's cast gives
        y = np.clip(blocks / scale[..., None], -FP8_MAX, FP8_MAX).reshape(t, w)
    # Nearest e4m3 value by search in the sorted table of finite magnitudes (ties: the even code).
    mags = E4M3[:0x7F]  # codes 0x00..0x7E, increasing
    a = np.abs(y)
    hi = np.clip(np.searchsorted(mags, a), 1, len(mags) - 1)
    lo = hi - 1
    dlo, dhi = a - mags[lo], mags[hi] - a
    code = np.where((dhi < dlo) | ((dhi == dlo) & (hi % 2 == 0)), hi, lo).astype(np.uint8)
    code = np.where(np.isnan(y), np.uint8(0x7F), code)  # a non-finite block quantizes to NaN, as in torch
    code |= np.where(np.signbit(y), 0x80, 0).astype(np.uint8)  # -0 stays -0, as in torch
    return np.concatenate(
        [np.ascontiguousarray(scale.T).view(np.uint8).reshape(-1), np.ascontiguousarray(code.T).reshape(-1)]
    )


def dequantize(body, tokens: int, width: int, block: int) -> np.ndarray:
    """An fp8 body (scales float32 [B, T], then e4m3 [W, T]) -> uint16 bf16 bits [T, W]."""
    b = width // block
    flat = np.frombuffer(body, np.uint8) if not isinstance(body, np.ndarray) else body.reshape(-1)
    scale = flat[: 4 * b * tokens].view(np.float32).reshape(b, tokens)
    q = flat[4 * b * tokens : 4 * b * tokens + width * tokens].reshape(b, block, tokens)
    x = E4M3[q] * scale[:, None, :]  # [B, H, T] float32
    return np.ascontiguousarray(bf16_bits(x).reshape(width, tokens).T)


def _half_ulp_table() -> np.ndarray:
    """Half the spacing of e4m3 values at each code: the most rounding to that code can have moved a value
    (exponent field e >= 1: 2^(e-7) / 16; subnormals: 2^-10). NaN codes: inf."""
    b = np.arange(256)
    exp = (b >> 3) & 0xF
    half = np.where(exp == 0, 2.0**-10, 2.0 ** (np.maximum(exp, 1) - 7.0) / 16)
    return np.where((b & 0x7F) == 0x7F, np.inf, half).astype(np.float32)


E4M3_HALF_ULP = _half_ulp_table()


def fp8_error_bound(body, tokens: int, width: int, block: int) -> np.ndarray:
    """float32 [T, W]: per stored value, the largest quantization error it can carry (half an e4m3 step at its
    code, times its block's scale; the final rounding to bf16 is left to the caller's bf16 allowance)."""
    b = width // block
    flat = np.frombuffer(body, np.uint8) if not isinstance(body, np.ndarray) else body.reshape(-1)
    scale = flat[: 4 * b * tokens].view(np.float32).reshape(b, tokens)
    q = flat[4 * b * tokens : 4 * b * tokens + width * tokens].reshape(b, block, tokens)
    return np.ascontiguousarray((E4M3_HALF_ULP[q] * scale[:, None, :]).reshape(width, tokens).T)


@dataclass(frozen=True)
class Codec:
    encoding: str = "planes_zstd"
    level: int = 1
    block: int = 0  # fp8: the hidden size (one scale per token per block of this many channels)

    def __post_init__(self):
        if self.encoding not in ENCODINGS:
            raise ValueError(f"unknown hidden-state encoding {self.encoding!r}; choose one of {ENCODINGS}")
        if self.encoding == "fp8" and self.block <= 0:
            raise ValueError("the fp8 encoding needs the hidden size (Codec.block)")

    @property
    def layout(self) -> str:
        """The uncompressed body the engines produce for this encoding (a dump header's `layout`)."""
        return "fp8" if self.encoding == "fp8" else "planes"

    @property
    def compressed(self) -> bool:
        return self.encoding != "raw"

    def split(self, tokens: int, width: int) -> tuple[int, int]:
        """Bytes of the head (stored as is) and of the tail (compressed) of a [tokens, width] column."""
        if self.encoding == "fp8":
            if width % self.block:
                raise CodecError(f"width {width} is not a whole number of {self.block}-channel blocks")
            return 0, (4 * (width // self.block) + width) * tokens  # one zstd frame: the scales and the values
        return width * tokens, width * tokens

    def segments(self, width: int) -> list[tuple[int, int]]:
        """The body's channel-major parts as (rows, bytes per token per row): a chunk of tokens is a column
        range of each (assembling prefill chunks, keeping only masked tokens)."""
        if self.encoding == "fp8":
            return [(width // self.block, 4), (width, 1)]
        return [(2 * width, 1)]

    def select_tokens(self, body: np.ndarray, tokens: int, width: int, keep: np.ndarray) -> np.ndarray:
        """The body of only the tokens where `keep` (bool [tokens]) is set."""
        flat, parts, at = np.asarray(body, np.uint8).reshape(-1), [], 0
        for rows, item in self.segments(width):
            seg = flat[at : at + rows * tokens * item].reshape(rows, tokens, item)
            parts.append(seg[:, keep].reshape(-1))
            at += rows * tokens * item
        return np.concatenate(parts) if parts else flat[:0]

    def encode(self, body) -> np.ndarray:
        """A body (head then tail, uncompressed, one buffer) -> the stored value, one contiguous uint8 array."""
        flat = np.ascontiguousarray(np.asarray(body, dtype=np.uint8)).reshape(-1)
        head = self._head_of(flat.size)
        value = self.allocate(head, flat.size - head)
        value[:head] = flat[:head]
        return self.finish(value, head, flat[head:])

    def _head_of(self, body_bytes: int) -> int:
        return 0 if self.encoding == "fp8" else body_bytes // 2

    def allocate(self, head: int, tail: int) -> np.ndarray:
        """Room for a stored value: the caller puts the head first, `finish` adds the tail.

        From Arrow's pool: memory already touched and reused from sample to sample (no page faults)."""
        size = head + (tail if not self.compressed else _zstd_bound(tail))
        return np.frombuffer(pa.allocate_buffer(size), np.uint8)

    def finish(self, value: np.ndarray, head: int, tail, tail_bytes: int | None = None) -> np.ndarray:
        """`value[:head]` holds the head: add the tail as this encoding stores it; the stored value. `tail`
        None: it is already in place (raw, read straight into the value), `tail_bytes` long."""
        if not self.compressed:
            n = tail_bytes if tail is None else np.asarray(tail).size
            if tail is not None:
                value[head : head + n] = tail
            return value[: head + n]
        frame = pa.Codec("zstd", compression_level=self.level).compress(tail, asbytes=False)
        value[head : head + frame.size] = np.frombuffer(frame, np.uint8)
        return value[: head + frame.size]

    def _tail(self, value, tokens: int, width: int) -> tuple[pa.Buffer, pa.Buffer]:
        head, tail = self.split(tokens, width)
        buf = pa.py_buffer(value)
        if buf.size < head:
            raise CodecError(f"stored value has {buf.size} bytes, fewer than the {head} of its head")
        rest = buf.slice(head)
        if not self.compressed:
            if rest.size != tail:
                raise CodecError(f"raw value has {buf.size} bytes, expected {head + tail}")
            return buf.slice(0, head), rest
        try:
            out = pa.Codec("zstd").decompress(rest, decompressed_size=tail)
        except (OSError, pa.ArrowException) as e:
            raise CodecError(f"compressed part does not decompress to {tail} bytes: {e}") from None
        if out.size != tail:
            raise CodecError(f"compressed part decompresses to {out.size} bytes, expected {tail}")
        return buf.slice(0, head), out

    def check(self, value, tokens: int, width: int) -> None:
        """Raise CodecError unless the value decodes to a body of [tokens, width]; nothing is kept (verify)."""
        self._tail(value, tokens, width)

    def decode(self, value, tokens: int, width: int) -> np.ndarray:
        """A stored value -> its body, uint8: planes [2, W, T]; fp8: the flat head and tail."""
        head, tail = self._tail(value, tokens, width)
        body = np.concatenate([np.frombuffer(head, np.uint8), np.frombuffer(tail, np.uint8)])
        return body if self.encoding == "fp8" else body.reshape(2, width, tokens)

    def decode_bits(self, value, tokens: int, width: int) -> np.ndarray:
        """A stored value -> uint16 bf16 bits [T, W] (fp8: dequantized)."""
        return self.body_bits(self.decode(value, tokens, width), tokens, width)

    def body_bits(self, body, tokens: int, width: int) -> np.ndarray:
        """An uncompressed body -> uint16 bf16 bits [T, W] (fp8: dequantized)."""
        if self.encoding == "fp8":
            return dequantize(body, tokens, width, self.block)
        return from_planes(np.asarray(body, np.uint8).reshape(2, width, tokens))

    def body_from_bits(self, bits: np.ndarray) -> np.ndarray:
        """uint16 bf16 bits [T, W] -> the body an engine would produce (host; tests, benchmarks)."""
        if self.encoding == "fp8":
            return quantize(bits, self.block)
        return to_planes(bits)

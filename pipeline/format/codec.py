"""The hidden-state codec: bf16 bits as two byte planes, channel-major; the high plane zstd, the low plane stored.

One sample's hidden tensor [T, W] (bf16; W = K*H for the aux layers, H for the final state) is stored as one
binary value:

    planes  = bits.view(uint8).reshape(T, W, 2).transpose(2, 1, 0)   # [2, W, T]: plane 0 low bytes, 1 high bytes
    value   = planes[0].tobytes() + encode(planes[1].tobytes())

`raw`: the high plane as is (2*W*T bytes in all). `planes_zstd`: the high plane as one zstd frame (level 1,
content size in the frame header, so any zstd decoder reads it). Why this layout:
the high byte holds the sign and exponent, which repeat along a channel (channel-major puts a channel's tokens
side by side), so it compresses to ~0.4; the low byte is mantissa noise that no codec shrinks, so it is stored
and costs a memcpy. Both planes are produced on the GPU before the device-to-host copy (patches/), so the host
only compresses. One call encodes one sample on one thread; the actor runs many at once on a thread pool
(zstd and the copies release the GIL).

Decoding without this project, in numpy and pyarrow (T = num_tokens, W from the schema metadata):

    lo = np.frombuffer(value, np.uint8, W * T)
    hi = np.frombuffer(pa.Codec("zstd").decompress(value[W * T:], W * T), np.uint8)   # raw: value[W * T:]
    bits = (hi.astype(np.uint16) << 8 | lo).reshape(W, T).T                           # [T, W] bf16 bits
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pyarrow as pa

ENCODINGS = ("planes_zstd", "raw")


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


@dataclass(frozen=True)
class Codec:
    encoding: str = "planes_zstd"
    level: int = 1

    def __post_init__(self):
        if self.encoding not in ENCODINGS:
            raise ValueError(f"unknown hidden-state encoding {self.encoding!r}; choose one of {ENCODINGS}")

    def encode(self, planes) -> np.ndarray:
        """Byte planes (a buffer of 2*W*T bytes, low plane first) -> the stored value, one contiguous uint8 array."""
        flat = np.ascontiguousarray(np.asarray(planes, dtype=np.uint8)).reshape(-1)
        half = flat.size // 2
        value = self.allocate(half)
        value[:half] = flat[:half]
        return self.finish(value, half, flat[half:])

    def allocate(self, half: int) -> np.ndarray:
        """Room for a stored value whose planes are `half` bytes each; the caller puts the low plane first.

        From Arrow's pool: memory already touched and reused from sample to sample (no page faults)."""
        size = 2 * half if self.encoding == "raw" else half + _zstd_bound(half)
        return np.frombuffer(pa.allocate_buffer(size), np.uint8)

    def finish(self, value: np.ndarray, half: int, hi) -> np.ndarray:
        """`value[:half]` holds the low plane: add the high plane as this encoding stores it; the stored value."""
        if self.encoding == "raw":
            if hi is not None:
                value[half : 2 * half] = hi
            return value[: 2 * half]
        frame = pa.Codec("zstd", compression_level=self.level).compress(hi, asbytes=False)
        value[half : half + frame.size] = np.frombuffer(frame, np.uint8)
        return value[: half + frame.size]

    def check(self, value, tokens: int, width: int) -> None:
        """Raise CodecError unless the value decodes to [2, W, T]; nothing is kept (verify's fast path)."""
        buf = pa.py_buffer(value)
        n = tokens * width
        if buf.size < n:
            raise CodecError(f"stored value has {buf.size} bytes, fewer than the {n} of its low plane")
        rest = buf.slice(n)
        if self.encoding == "raw":
            if rest.size != n:
                raise CodecError(f"raw value has {buf.size} bytes, expected {2 * n}")
            return
        try:
            hi = pa.Codec("zstd").decompress(rest, decompressed_size=n)
        except (OSError, pa.ArrowException) as e:
            raise CodecError(f"high plane does not decompress to {n} bytes: {e}") from None
        if hi.size != n:
            raise CodecError(f"high plane decompresses to {hi.size} bytes, expected {n}")

    def decode(self, value, tokens: int, width: int) -> np.ndarray:
        """A stored value -> byte planes [2, W, T] (uint8)."""
        buf = pa.py_buffer(value)
        n = tokens * width
        if buf.size < n:
            raise CodecError(f"stored value has {buf.size} bytes, fewer than the {n} of its low plane")
        lo = np.frombuffer(buf, np.uint8, n)
        rest = buf.slice(n)
        if self.encoding == "raw":
            if rest.size != n:
                raise CodecError(f"raw value has {buf.size} bytes, expected {2 * n}")
            hi = np.frombuffer(rest, np.uint8)
        else:
            try:
                hi = np.frombuffer(pa.Codec("zstd").decompress(rest, decompressed_size=n), np.uint8)
            except (OSError, pa.ArrowException) as e:
                raise CodecError(f"high plane does not decompress to {n} bytes: {e}") from None
        return np.stack([lo.reshape(width, tokens), hi.reshape(width, tokens)])

    def decode_bits(self, value, tokens: int, width: int) -> np.ndarray:
        """A stored value -> uint16 bf16 bits [T, W]."""
        return from_planes(self.decode(value, tokens, width))

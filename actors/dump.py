"""Reads the per-request dumps written by the SGLang hook (patches/sglang/*/hidden_harvest_hook.py).

Layout: 8-byte little-endian header length, a JSON header, then the aux body and the final layer's body in
the header's `layout`, the uncompressed form of what the shard codec stores (pipeline/format/codec.py):
`planes` (bf16 bits split into a low and a high byte plane, channel-major: [2, K*H, T] and [2, H, T]) or `fp8`
(float32 scales [B, T], one per token per H-wide layer block, then e4m3fn values [W, T]).

`read_dump` reads and checks only the header and the file size, and keeps the file open: the engine unlinks
the dump at once (the open descriptor keeps its bytes), validation needs nothing more, and the body is read
by whichever encoder thread takes the sample, into memory from Arrow's pool (reused, already touched), in
one system call. Nothing big happens on the thread that serves requests.
"""

from __future__ import annotations

import json
import os
import struct
import threading
from dataclasses import MISSING, dataclass, fields
from pathlib import Path

import numpy as np
import pyarrow as pa

from pipeline.format.codec import Codec

_MAX_HEADER = 1 << 20


class DumpError(ValueError):
    pass


@dataclass(frozen=True)
class CaptureHeader:
    """What an engine says of one capture; validation (actors/validate.py) reads only this.

    The SGLang hook writes it as the dump's JSON header. The hook runs inside the server and imports
    nothing of the project, so it spells the keys out itself; tests/unit/actors/test_dump.py pins that
    the keys it writes are exactly these fields."""

    rid: str
    num_tokens: int
    prefix_len: int  # tokens the server took from a cache instead of computing (must be 0)
    ids_sha256: str  # over the int32 ids the forward ran
    nonfinite: int  # non-finite values among the captured ones, counted on the device
    aux_shape: tuple[int, int]  # [T, K*H]
    last_shape: tuple[int, int]  # [T, H]
    source_dtype: str  # the dtype the model computed in
    final_layer: str  # "post_norm": the final norm's output; "pre_norm": its input
    layout: str = "planes"  # the body: "planes" (bf16 byte planes) or "fp8" (scales, e4m3 values)
    error: str | None = None  # the capture failed inside the server, and why

    @classmethod
    def from_dict(cls, d: dict) -> CaptureHeader:
        missing = [f.name for f in fields(cls) if f.default is MISSING and f.name not in d]
        if missing:
            raise DumpError(f"dump header lacks {missing} (a hook older than this client?)")
        unknown = sorted(set(d) - {f.name for f in fields(cls)})
        if unknown:
            raise DumpError(f"dump header has keys this client does not know: {unknown}")
        aux, last = (tuple(int(x) for x in d[k]) for k in ("aux_shape", "last_shape"))
        return cls(**{**d, "aux_shape": aux, "last_shape": last})

    def to_dict(self) -> dict:
        d = {f.name: getattr(self, f.name) for f in fields(self)}
        return {**d, "aux_shape": list(self.aux_shape), "last_shape": list(self.last_shape)}


def body_codec(header: CaptureHeader) -> Codec:
    """The codec whose body layout a dump carries (its sizes; for fp8 the block is the hidden size)."""
    if header.layout == "planes":
        return Codec("planes_zstd")
    if header.layout == "fp8":
        return Codec("fp8", block=max(int(header.last_shape[1]), 1))
    raise DumpError(f"dump for {header.rid} has an unknown layout {header.layout!r}")


class Capture:
    def __init__(self, header: CaptureHeader, fd: int | None, offset: int, body: np.ndarray | None = None):
        self.header = header
        self._fd = fd
        self._offset = offset
        self._body = body
        self._lock = threading.Lock()
        self._codec = body_codec(header)
        self.aux_bytes = sum(self._codec.split(*header.aux_shape))
        self.last_bytes = sum(self._codec.split(*header.last_shape))

    def _load(self) -> np.ndarray:
        with self._lock:
            if self._body is None:
                size = self.aux_bytes + self.last_bytes
                buf = pa.allocate_buffer(size)
                try:
                    got = os.preadv(self._fd, [buf], self._offset)
                finally:
                    self.close()
                if got != size:
                    raise DumpError(f"dump for {self.header.rid} shrank while being read ({got} of {size} bytes)")
                self._body = np.frombuffer(buf, np.uint8)
            return self._body

    def _shaped(self, body: np.ndarray, shape: tuple[int, int]) -> np.ndarray:
        t, w = shape
        return body.reshape(2, w, t) if self.header.layout == "planes" else body

    @property
    def aux(self) -> np.ndarray:
        """The aux body: uint8 planes [2, K*H, T], or the flat fp8 body (reads the body on first use)."""
        return self._shaped(self._load()[: self.aux_bytes], self.header.aux_shape)

    @property
    def last(self) -> np.ndarray:
        """The final layer's body: uint8 planes [2, H, T], or the flat fp8 body."""
        return self._shaped(self._load()[self.aux_bytes :], self.header.last_shape)

    def encode(self, codec: Codec) -> tuple[np.ndarray, np.ndarray]:
        """The stored values of both columns, read straight from the file: each head lands where it is
        stored and only the tails pass through a scratch buffer (raw: no buffer between at all)."""
        if codec.layout != self.header.layout:
            raise DumpError(
                f"dump for {self.header.rid} holds {self.header.layout}, the output stores {codec.encoding}"
            )
        if self._fd is None:  # already read (or built in memory): encode from the bodies
            return codec.encode(self.aux), codec.encode(self.last)
        (ha, ta), (hl, tl) = codec.split(*self.header.aux_shape), codec.split(*self.header.last_shape)
        va, vl = codec.allocate(ha, ta), codec.allocate(hl, tl)
        if not codec.compressed:
            parts, tails = [va[: ha + ta], vl[: hl + tl]], (None, None)
        else:
            tails = (np.frombuffer(pa.allocate_buffer(ta), np.uint8), np.frombuffer(pa.allocate_buffer(tl), np.uint8))
            parts = [va[:ha], tails[0], vl[:hl], tails[1]]
        try:
            got = os.preadv(self._fd, [p for p in parts if p.size], self._offset)  # fp8 has no head
        finally:
            self.close()
        want = ha + ta + hl + tl
        if got != want:
            raise DumpError(f"dump for {self.header.rid} shrank while being read ({got} of {want} bytes)")
        return codec.finish(va, ha, tails[0], ta), codec.finish(vl, hl, tails[1], tl)

    def bits(self) -> tuple[np.ndarray, np.ndarray]:
        """uint16 bf16 bits [T, K*H] and [T, H], dequantized for fp8 (tests and comparisons; the job never
        needs them)."""
        return (
            self._codec.body_bits(self.aux, *self.header.aux_shape),
            self._codec.body_bits(self.last, *self.header.last_shape),
        )

    def close(self) -> None:
        """Release the file (and with it a dump already unlinked); safe to call twice."""
        fd, self._fd = self._fd, None
        if fd is not None:
            os.close(fd)

    def release(self) -> None:
        """Drop the file and the body read from it, once the sample is encoded or rejected."""
        self.close()
        self._body = None


def dump_path(dump_dir: Path, rid: str) -> Path:
    return dump_dir / f"{rid}.hhd"


def read_dump(path: Path) -> Capture:
    """Open a dump, parse and check its header against its size; the body is read later (Capture.aux/.last)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        size = os.fstat(fd).st_size
        head = os.pread(fd, 8, 0)
        if len(head) < 8:
            raise DumpError(f"dump {path.name} is truncated")
        (n,) = struct.unpack("<Q", head)
        if n > _MAX_HEADER or size < 8 + n:
            raise DumpError(f"dump {path.name} is truncated ({size} bytes)")
        try:
            header = CaptureHeader.from_dict(json.loads(os.pread(fd, n, 8)))
            codec = body_codec(header)
            want = sum(codec.split(*header.aux_shape)) + sum(codec.split(*header.last_shape))
        except DumpError as e:
            raise DumpError(f"dump {path.name}: {e}") from None
        except (ValueError, KeyError, TypeError) as e:  # CodecError too: widths not whole blocks
            raise DumpError(f"dump {path.name} has an unreadable header: {e}") from None
        if size - 8 - n != want:
            raise DumpError(f"dump {path.name} holds {size - 8 - n} bytes, header says {want}")
        return Capture(header, fd, 8 + n)
    except BaseException:
        os.close(fd)
        raise

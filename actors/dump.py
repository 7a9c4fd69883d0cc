"""Reads the per-request dumps written by the SGLang hook (patches/sglang/*/hidden_harvest_hook.py).

Layout: 8-byte little-endian header length, a JSON header, then the aux planes [2, K*H, T] and the final
planes [2, H, T] as uint8 (bf16 bits split into a low and a high byte plane, channel-major: the layout the
shard codec stores, pipeline/format/codec.py).

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

from pipeline.format.codec import Codec, from_planes

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
    layout: str = "planes"
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


class Capture:
    def __init__(self, header: CaptureHeader, fd: int | None, offset: int, body: np.ndarray | None = None):
        self.header = header
        self._fd = fd
        self._offset = offset
        self._body = body
        self._lock = threading.Lock()
        (t, wa), (tl, wl) = header.aux_shape, header.last_shape
        self.aux_shape, self.last_shape = (2, wa, t), (2, wl, tl)

    def _load(self) -> np.ndarray:
        with self._lock:
            if self._body is None:
                size = 2 * (int(np.prod(self.aux_shape[1:])) + int(np.prod(self.last_shape[1:])))
                buf = pa.allocate_buffer(size)
                try:
                    got = os.preadv(self._fd, [buf], self._offset)
                finally:
                    self.close()
                if got != size:
                    raise DumpError(f"dump for {self.header.rid} shrank while being read ({got} of {size} bytes)")
                self._body = np.frombuffer(buf, np.uint8)
            return self._body

    @property
    def aux(self) -> np.ndarray:
        """uint8 planes [2, K*H, T] (reads the body on first use)."""
        n = int(np.prod(self.aux_shape))
        return self._load()[:n].reshape(self.aux_shape)

    @property
    def last(self) -> np.ndarray:
        """uint8 planes [2, H, T]."""
        n = int(np.prod(self.aux_shape))
        return self._load()[n:].reshape(self.last_shape)

    def encode(self, codec: Codec) -> tuple[np.ndarray, np.ndarray]:
        """The stored values of both columns, read straight from the file: each low plane lands where it is
        stored and only the high planes pass through a scratch buffer (raw: no buffer between at all)."""
        if self._fd is None:  # already read (or built in memory): encode from the planes
            return codec.encode(self.aux), codec.encode(self.last)
        na, nl = int(np.prod(self.aux_shape[1:])), int(np.prod(self.last_shape[1:]))
        va, vl = codec.allocate(na), codec.allocate(nl)
        if codec.encoding == "raw":
            parts, his = [va[: 2 * na], vl[: 2 * nl]], (None, None)
        else:
            his = (np.frombuffer(pa.allocate_buffer(na), np.uint8), np.frombuffer(pa.allocate_buffer(nl), np.uint8))
            parts = [va[:na], his[0], vl[:nl], his[1]]
        try:
            got = os.preadv(self._fd, parts, self._offset)
        finally:
            self.close()
        if got != 2 * (na + nl):
            raise DumpError(f"dump for {self.header.rid} shrank while being read ({got} of {2 * (na + nl)} bytes)")
        return codec.finish(va, na, his[0]), codec.finish(vl, nl, his[1])

    def bits(self) -> tuple[np.ndarray, np.ndarray]:
        """uint16 bf16 bits [T, K*H] and [T, H] (for tests and comparisons; the job never needs them)."""
        return from_planes(self.aux), from_planes(self.last)

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
            (ta, wa), (tl, wl) = header.aux_shape, header.last_shape
            want = 2 * (ta * wa + tl * wl)
        except DumpError as e:
            raise DumpError(f"dump {path.name}: {e}") from None
        except (ValueError, KeyError, TypeError) as e:
            raise DumpError(f"dump {path.name} has an unreadable header: {e}") from None
        if size - 8 - n != want:
            raise DumpError(f"dump {path.name} holds {size - 8 - n} bytes, header says {want}")
        return Capture(header, fd, 8 + n)
    except BaseException:
        os.close(fd)
        raise

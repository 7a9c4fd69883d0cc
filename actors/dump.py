"""Reads the per-request dump files written by the SGLang hook (patches/sglang/*/hidden_harvest_hook.py).

Layout: 8-byte little-endian header length, a JSON header, the aux block [T, K*H] and the final
block [T, H] as raw bf16 bits. Kept next to the writer's description in patches/README.md.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np


@dataclass
class Capture:
    header: dict
    aux: np.ndarray  # uint16 [T, K*H]
    last: np.ndarray  # uint16 [T, H]


class DumpError(ValueError):
    pass


def dump_path(dump_dir: Path, rid: str) -> Path:
    return dump_dir / f"{rid}.hhd"


def read_dump(path: Path) -> Capture:
    data = path.read_bytes()
    if len(data) < 8:
        raise DumpError(f"dump {path.name} is truncated")
    (n,) = struct.unpack_from("<Q", data, 0)
    if len(data) < 8 + n or (len(data) - 8 - n) % 2:
        raise DumpError(f"dump {path.name} is truncated ({len(data)} bytes)")
    try:
        header = json.loads(data[8 : 8 + n])
    except ValueError as e:
        raise DumpError(f"dump {path.name} has an unreadable header: {e}") from None
    body = np.frombuffer(data, dtype=np.uint16, offset=8 + n)
    (ta, wa), (tl, wl) = header["aux_shape"], header["last_shape"]
    if body.size != ta * wa + tl * wl:
        raise DumpError(f"dump {path.name} holds {body.size} values, header says {ta * wa + tl * wl}")
    return Capture(header, body[: ta * wa].reshape(ta, wa), body[ta * wa :].reshape(tl, wl))

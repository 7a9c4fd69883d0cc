"""Bytes per token and encode speed of each hidden-state encoding, on the real hidden states of a finished run.

  python bench/bench_storage.py [OUTPUT] [--json bench/results/storage.json]   (default: out/default, `make run`)

Every committed sample is decoded and re-encoded with the project's own codec and shard writer under each
option, so the sizes are what the job would commit. Raw = tokens x (aux layers + 1) x hidden x 2 bytes (bf16).
The format-1 option (list<uint16> + BYTE_STREAM_SPLIT + zstd-1, what shards held before the codec) is the
reference the codec replaced; "row-major" shows what the channel-major plane order buys.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import io
import json
import os
import platform
import sys
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from pipeline.format.codec import Codec, to_planes  # noqa: E402
from pipeline.format.manifest import read_manifest  # noqa: E402
from pipeline.format.shards import (  # noqa: E402
    ShardLayout,
    decode_row,
    encode_bits,
    list_shards,
    read_layout,
    write_shard,
)
from pipeline.format.storage import Store  # noqa: E402


def _format1_bytes(samples: list[dict]) -> int:
    """The format-1 shard: hidden states as list<uint16>, BYTE_STREAM_SPLIT + zstd-1."""
    cols = {
        k: pa.array([s[k].reshape(-1) for s in samples], pa.list_(pa.uint16()))
        for k in ("aux_hidden_states", "last_hidden_state")
    }
    buf = io.BytesIO()
    pq.write_table(
        pa.table(cols),
        buf,
        compression="zstd",
        compression_level=1,
        use_dictionary=False,
        use_byte_stream_split=[f"{c}.list.element" for c in cols],
    )
    return buf.tell()


def _row_major_bytes(samples: list[dict]) -> int:
    """The high plane compressed in token-major order instead of channel-major (same codec otherwise)."""
    codec, total = Codec("planes_zstd"), 0
    for s in samples:
        for k in ("aux_hidden_states", "last_hidden_state"):
            planes = np.ascontiguousarray(to_planes(s[k]).transpose(0, 2, 1))  # [2, T, W]
            total += sum(memoryview(p).nbytes for p in codec.encode(planes))
    return total


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("output", nargs="?", default="out/default")
    ap.add_argument("--json", default=None, help="also write the results here")
    args = ap.parse_args()
    store = Store(args.output)
    manifest = read_manifest(store)
    base = ShardLayout(tuple(manifest["aux_layers"]), manifest["hidden_size"])
    k, h = len(base.aux_layers), base.hidden_size
    layouts = {
        "planes_zstd (default)": base,
        "planes_zstd + last masked": dataclasses.replace(base, last_rows="masked"),
        "raw": dataclasses.replace(base, encoding="raw"),
    }
    tokens = masked = 0
    sizes: dict[str, int] = {}
    seconds: dict[str, float] = {}
    scratch = Store(str(Path(args.output) / ".bench-storage"))
    for rel in list_shards(store):
        with store.fs.open(store.path(rel), "rb") as f:
            table = pq.read_table(f)
        meta = read_layout(table.schema)
        samples = [decode_row(table, i, meta, as_torch=False) for i in range(table.num_rows)]
        tokens += sum(s["num_tokens"] for s in samples)
        masked += sum(int(s["loss_mask"].sum()) for s in samples)
        for name, layout in layouts.items():
            t0 = time.perf_counter()
            enc = [
                encode_bits(
                    s["sample_id"],
                    s["input_ids"].tolist(),
                    s["loss_mask"].tolist(),
                    s["aux_hidden_states"],
                    s["last_hidden_state"],
                    layout,
                )
                for s in samples
            ]
            shard, size = write_shard(scratch, enc, layout)
            seconds[name] = seconds.get(name, 0.0) + time.perf_counter() - t0
            sizes[name] = sizes.get(name, 0) + size
            scratch.fs.rm(scratch.path(shard))
        for name, fn in (
            ("format 1: list<uint16> BSS + zstd-1", _format1_bytes),
            ("planes_zstd, row-major", _row_major_bytes),
        ):
            t0 = time.perf_counter()
            sizes[name] = sizes.get(name, 0) + fn(samples)
            seconds[name] = seconds.get(name, 0.0) + time.perf_counter() - t0
    raw = tokens * (k + 1) * h * 2
    committed = manifest["totals"]["bytes"]
    print(
        f"{args.output}: {tokens:,} tokens ({masked:,} masked), raw bf16 {raw:,} bytes ({(k + 1) * h * 2} bytes/token)"
    )
    print(
        f"committed by the run (manifest totals.bytes, {manifest['data_settings']['encoding']}): {committed:,} bytes = {committed / raw:.4f} of raw"
    )
    print(f"{'option':38s} {'bytes':>14s} {'bytes/token':>12s} {'vs raw':>8s} {'MB/s (raw), 1 thread':>21s}")
    result = {
        "command": "python bench/bench_storage.py " + " ".join(sys.argv[1:]),
        "machine": f"{os.cpu_count()} CPU cores, {platform.machine()}, no GPU",
        "date": datetime.date.today().isoformat(),
        "tokens": tokens,
        "masked_tokens": masked,
        "raw_bytes": raw,
        "committed_bytes": committed,
        "committed_ratio_vs_raw": committed / raw,
        "options": {},
    }
    for name, size in sizes.items():
        rate = raw / seconds[name] / 1e6
        print(f"{name:38s} {size:14,d} {size / tokens:12.1f} {size / raw:8.4f} {rate:21.1f}")
        result["options"][name] = {
            "bytes": size,
            "bytes_per_token": size / tokens,
            "ratio_vs_raw": size / raw,
            "raw_MB_per_s": rate,
        }
    print(json.dumps(result))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()

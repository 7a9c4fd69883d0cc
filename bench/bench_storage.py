"""Bytes per token of each storage option, on the real hidden states of a finished run.

  python bench/bench_storage.py [OUTPUT]      (default: out/default, made by `make run`)

Every committed shard is re-written with the project's own shard writer under each option, so the
numbers are what the job would commit. Raw = tokens x (aux layers + 1) x hidden x 2 bytes (bf16).
"""

from __future__ import annotations

import dataclasses
import io
import json
import sys
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from pipeline.manifest import read_manifest  # noqa: E402
from pipeline.shards import CapturedSample, ShardLayout, build_table, decode_row, list_shards, read_layout  # noqa: E402
from pipeline.storage import Store  # noqa: E402


def _encode(table: pa.Table, **kw) -> int:
    buf = io.BytesIO()
    pq.write_table(table, buf, **kw)
    return buf.tell()


def main() -> None:
    output = sys.argv[1] if len(sys.argv) > 1 else "out/default"
    store = Store(output)
    manifest = read_manifest(store)
    base = ShardLayout(tuple(manifest["aux_layers"]), manifest["hidden_size"])
    k, h = len(base.aux_layers), base.hidden_size
    tokens = masked = 0
    sizes: dict[str, int] = {}
    seconds: dict[str, float] = {}
    hidden = ["aux_hidden_states.list.element", "last_hidden_state.list.element"]
    options = {
        "bss_zstd1 (default)": (base, dict(compression="zstd", compression_level=1, use_dictionary=["sample_id"], use_byte_stream_split=hidden)),
        "bss_zstd1 + last masked": (dataclasses.replace(base, last_rows="masked"),
                                    dict(compression="zstd", compression_level=1, use_dictionary=["sample_id"], use_byte_stream_split=hidden)),
        "zstd1, no BYTE_STREAM_SPLIT": (base, dict(compression="zstd", compression_level=1, use_dictionary=False)),
        "uncompressed": (base, dict(compression="none", use_dictionary=False)),
    }  # fmt: skip
    for rel in list_shards(store):
        with store.fs.open(store.path(rel), "rb") as f:
            table = pq.read_table(f)
        meta = read_layout(table.schema)
        samples = []
        for i in range(table.num_rows):
            r = decode_row(table, i, meta, as_torch=False)
            samples.append(CapturedSample(r["sample_id"], r["input_ids"].tolist(), r["loss_mask"].tolist(), r["aux_hidden_states"], r["last_hidden_state"]))
            tokens += r["num_tokens"]
            masked += int(r["loss_mask"].sum())
        for name, (layout, kw) in options.items():
            t0 = time.perf_counter()
            sizes[name] = sizes.get(name, 0) + _encode(build_table(samples, layout), **kw)
            seconds[name] = seconds.get(name, 0.0) + time.perf_counter() - t0
    raw = tokens * (k + 1) * h * 2
    print(f"{output}: {tokens:,} tokens ({masked:,} masked), raw bf16 {raw:,} bytes ({(k + 1) * h * 2} bytes/token)")
    print(f"committed by the run (manifest totals.bytes): {manifest['totals']['bytes']:,} bytes = "
          f"{manifest['totals']['bytes'] / raw:.4f} of raw")  # fmt: skip
    print(f"{'option':32s} {'bytes':>14s} {'bytes/token':>12s} {'vs raw':>8s} {'write MB/s (raw)':>17s}")
    result = {"tokens": tokens, "masked_tokens": masked, "raw_bytes": raw, "committed_bytes": manifest["totals"]["bytes"], "options": {}}
    for name, size in sizes.items():
        rate = raw / seconds[name] / 1e6
        print(f"{name:32s} {size:14,d} {size / tokens:12.1f} {size / raw:8.4f} {rate:17.1f}")
        result["options"][name] = {"bytes": size, "bytes_per_token": size / tokens, "ratio_vs_raw": size / raw, "write_raw_MBps": rate}
    print(json.dumps(result))


if __name__ == "__main__":
    main()

"""How long the actor's host-side steps keep other Python threads waiting (the GIL), on any machine.

  python bench/probes/bench_gil_probe.py [--out bench/results/gil_probe_cpu.json]

The hf engine's forward thread launches device work from Python; a step that holds the GIL on another
thread of the actor would hold that up. Each step below runs a few times beside a probe thread that sleeps
0.2 ms in a loop; the probe's wake-up delay beyond its sleep (p50 and max) is how long it waited. Sizes are
those of one 1,000-token sample of a Llama-3-8B-shape model (3 aux layers + the final state). Cores also
count: on a machine with few cores a wake-up may wait for a core, not the GIL (compare with `idle`).
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import json
import os
import platform
import shlex
import shutil
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import pyarrow as pa

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))


def probed(fn, calls: int) -> dict:
    stop, waits = threading.Event(), []

    def probe() -> None:
        while not stop.is_set():
            t0 = time.perf_counter()
            time.sleep(0.0002)
            waits.append(time.perf_counter() - t0 - 0.0002)

    th = threading.Thread(target=probe)
    th.start()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    seconds = time.perf_counter() - t0
    stop.set()
    th.join()
    w = np.array(waits)
    return {
        "ms_per_call": round(seconds / calls * 1000, 2),
        "probe_wakeups": len(w),
        "probe_wait_p50_ms": round(float(np.median(w)) * 1000, 2),
        "probe_wait_max_ms": round(float(w.max()) * 1000, 2),
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "gil_probe_cpu.json")
    args = ap.parse_args()

    from pipeline.format.codec import Codec
    from pipeline.format.shards import EncodedSample, ShardLayout, ShardWriter
    from pipeline.format.storage import Store

    tokens, h = 1000, 4096
    width = 4 * h  # 3 aux layers + the final state
    rng = np.random.default_rng(0)
    planes = rng.integers(0, 256, 2 * width * tokens, dtype=np.uint8)
    # A high byte plane like real bf16 states: sign and exponent of normal values, which zstd compresses.
    high = (rng.normal(size=width * tokens).astype(np.float32).view(np.uint32) >> 24).astype(np.uint8)
    codec = Codec()
    value = codec.allocate(width * tokens)
    ids = np.arange(2 * tokens, dtype=np.int32)
    layout = ShardLayout((2, 16, 29), h)
    samples = [
        EncodedSample(
            f"s{i}",
            list(range(tokens)),
            [1] * tokens,
            codec.encode(planes[: 2 * 3 * h * tokens]),
            codec.encode(planes[: 2 * h * tokens]),
        )
        for i in range(8)
    ]
    rows = [{"sample_id": f"s{i}", "input_ids": list(range(1100)), "loss_mask": [1] * 1100} for i in range(128)]
    batch = pa.Table.from_pylist(rows)
    out_dir = Path(tempfile.mkdtemp(prefix="gil-probe-"))
    store = Store(str(out_dir))

    def write_row_group() -> None:
        shard = ShardWriter(store, layout, row_group_bytes=1 << 40)
        for s in samples:
            shard.add(s)
        shard.commit()

    steps = {
        "idle (sleep 20 ms)": (lambda: time.sleep(0.02), 10),
        "zstd level 1, one 16 MB high plane": (
            lambda: pa.Codec("zstd", compression_level=1).compress(high, asbytes=False),
            10,
        ),
        "Codec.encode, one 32 MB sample": (lambda: codec.encode(planes), 10),
        "numpy copy, 16 MB": (lambda: value.__setitem__(slice(0, width * tokens), planes[: width * tokens]), 20),
        "sha256 of 8 KB ids, x1000": (lambda: [hashlib.sha256(ids.tobytes()).hexdigest() for _ in range(1000)], 10),
        "ShardWriter, one 8-sample row group (260 MB) and commit": (write_row_group, 5),
        "to_pylist of a 128-row batch of 1,100-token rows": (lambda: batch.to_pylist(), 5),
    }
    try:
        results = {name: probed(fn, calls) for name, (fn, calls) in steps.items()}
    finally:
        shutil.rmtree(out_dir, ignore_errors=True)
    report = {
        "benchmark": "GIL probe: a thread sleeping 0.2 ms in a loop beside each host-side step of the actor",
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d"),
        "command": shlex.join(["python", "bench/probes/bench_gil_probe.py"] + sys.argv[1:]),
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}",
        "steps": results,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    for name, r in results.items():
        print(
            f"{name:58s} {r['ms_per_call']:8.1f} ms/call  probe wait p50 {r['probe_wait_p50_ms']:.2f} ms, max {r['probe_wait_max_ms']:.1f} ms"
        )


if __name__ == "__main__":
    main()

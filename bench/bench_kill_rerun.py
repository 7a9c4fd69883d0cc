"""A whole job killed midway and rerun: every row stored exactly once, at a size users run.

  python bench/bench_kill_rerun.py [--rows 100000] [--kill-at 0.1] [--out bench/results/kill_rerun_cpu.json]

Writes its own input: short pre-tokenized rows (4-16 tokens), every hundredth row repeating an earlier row's id.
`harvest run` of the default config (the real engine of the machine: SGLang, in CPU mode on a CPU) runs as a CLI
process on its own local Ray; once `--kill-at` of the expected shards are committed the driver is SIGKILLed, and
the same command is run again to the end. Then, from the output alone:
  - the manifest's totals account for every input row once;
  - `harvest verify` finds no sample_id twice and totals that match the shards;
  - the stored sample ids are exactly the input's distinct ids, each stored with the token ids of its first row
    (nothing lost, nothing duplicated, nothing paired with another row's tokens).
The long test (`make test-long`) runs this at 100k rows and asserts the same.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))
sys.path.insert(0, str(ROOT / "tests"))

from bench_throughput import machine  # noqa: E402

from pipeline.format.manifest import read_manifest  # noqa: E402
from pipeline.format.storage import Store  # noqa: E402
from pipeline.tools.verify import verify  # noqa: E402
from tests_support import harvest_command, sets  # noqa: E402

BATCH = 256
SETS = (
    f"extract.batch_size={BATCH}",
    "engine.max_in_flight=32",
    "ray.object_store_memory_mb=1000",
    "progress.interval_s=10",
)


def write_rows(path: Path, n: int, seed: int = 3) -> dict[str, list[int]]:
    """The input file; returns each distinct id's token ids (its first row's)."""
    rng = np.random.default_rng(seed)
    first: dict[str, list[int]] = {}
    with path.open("w") as f:
        for i in range(n):
            rid = f"r{int(rng.integers(0, i))}" if i and i % 100 == 0 else f"r{i}"
            ids = rng.integers(100, 49000, int(rng.integers(4, 17))).tolist()
            first.setdefault(rid, ids)
            f.write(json.dumps({"id": rid, "input_ids": ids}) + "\n")
    return first


def command(rows: Path, out: Path) -> list[str]:
    """The default config's `harvest run` on 2 CPUs (tests_support's), with this benchmark's settings after it."""
    return harvest_command(rows, out, *sets(*SETS))


def stored(out: Path) -> list[tuple[str, list[int]]]:
    """(sample_id, input_ids) of every sample in every shard."""
    pairs = []
    for f in sorted((out / "shards").glob("part-*.parquet")):
        t = pq.read_table(f, columns=["sample_id", "input_ids"])
        pairs += zip(t.column("sample_id").to_pylist(), t.column("input_ids").to_pylist(), strict=True)
    return pairs


def kill_and_rerun(n: int, kill_at: float, work: Path) -> dict:
    rows, out = work / "rows.jsonl", work / "out"
    first = write_rows(rows, n)
    env = dict(os.environ, RAY_ADDRESS="")
    kill_shards = max(1, int(n / BATCH * kill_at))
    t0 = time.monotonic()
    with (work / "first_run.log").open("w") as log:
        proc = subprocess.Popen(command(rows, out), cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
        while proc.poll() is None and len(list(out.glob("shards/part-*.parquet"))) < kill_shards:
            time.sleep(1)
        if proc.poll() is not None:
            raise RuntimeError(f"the first run ended (exit {proc.returncode}) before it could be killed")
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    killed_after = time.monotonic() - t0
    at_kill = len(list((out / "shards").glob("part-*.parquet")))
    t1 = time.monotonic()
    rerun = subprocess.run(command(rows, out), cwd=ROOT, env=env, capture_output=True, text=True)
    rerun_s = time.monotonic() - t1
    (work / "rerun.log").write_text(rerun.stderr)
    if rerun.returncode != 0:
        raise RuntimeError(f"the rerun failed (exit {rerun.returncode}): {rerun.stderr[-3000:]}")
    manifest = read_manifest(Store(str(out)))
    report = verify(str(out))
    pairs = stored(out)
    ids_stored = {sid for sid, _ in pairs}
    last = manifest["last_run"]
    return {
        "rows": n,
        "distinct_ids": len(first),
        "first_run": {"killed_after_s": round(killed_after, 1), "shards_at_kill": at_kill},
        "rerun": {
            "wall_s": round(rerun_s, 1),
            "samples": last.get("samples_ok"),
            "tokens": last.get("tokens"),
            "startup": last.get("startup"),
            "tokens_per_second_after_engine_start": last.get("tokens_per_second_after_engine_start"),
        },
        "totals": manifest["totals"],
        "verify": {"ok": report.ok, "problems": report.problems[:20]},
        "stored_samples": len(ids_stored),
        "stored_twice": len(pairs) - len(ids_stored),
        "missing": len(set(first) - ids_stored),
        "mispaired": sum(first.get(sid) != ids for sid, ids in pairs),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", type=int, default=100_000)
    ap.add_argument("--kill-at", type=float, default=0.1, help="the fraction of the expected shards before the kill")
    ap.add_argument("--work", type=Path, required=True, help="a directory for the input, the output and the logs")
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "kill_rerun_cpu.json")
    args = ap.parse_args()
    args.work.mkdir(parents=True, exist_ok=True)
    figures = kill_and_rerun(args.rows, args.kill_at, args.work)
    result = {
        "benchmark": "a whole job SIGKILLed midway and rerun to the end: every row exactly once",
        "command": f"python bench/bench_kill_rerun.py --rows {args.rows} --kill-at {args.kill_at} --work WORK",
        "machine": machine(),
        "date": datetime.date.today().isoformat(),
        "settings": dict(s.split("=", 1) for s in SETS),
        **figures,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    summary = {k: result[k] for k in ("rows", "stored_samples", "stored_twice", "missing", "mispaired")}
    sys.stdout.write(json.dumps(summary) + "\n")


if __name__ == "__main__":
    main()

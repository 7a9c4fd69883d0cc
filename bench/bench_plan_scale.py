"""Planning at scale: read, tokenize, dedup and the resume filter, its time and the driver's peak memory.

  python bench/bench_plan_scale.py [--rows 100000 300000 1000000] [--out bench/results/plan_scale_cpu.json]
  python bench/bench_plan_scale.py --rows 100000 --code OTHER_CHECKOUT --label before   # another version's job

Writes its own input: half pre-tokenized rows (log-uniform 16-512 tokens), half short chats (one user and one
assistant turn, rendered with the default model's template), 1 % of the rows repeating an earlier row's id.
Each size runs in a fresh driver process on a fresh local Ray (2 CPUs): the job's own steps, as `run` takes them,
up to the actor pool: tokenized_dataset(...).materialize(), the plan against an empty output (ledger, duplicates
file, skip keys), and every row through the resume filter (counted). The driver's peak RSS is its own
ru_maxrss (Ray's processes are apart); beside it, its RSS once the job's modules are imported and Ray started,
before the first row (what a driver costs at any input size).
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import resource
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
# --code: the child imports the job of another checkout (the "before" figure); this file's own helpers are here.
sys.path.insert(0, os.environ.get("HH_BENCH_CODE", str(ROOT)))

WORDS = [
    "the",
    "a",
    "of",
    "to",
    "and",
    "in",
    "is",
    "it",
    "you",
    "that",
    "he",
    "was",
    "for",
    "on",
    "are",
    "with",
    "as",
    "I",
    "his",
    "they",
    "be",
    "at",
    "one",
    "have",
    "this",
    "from",
]


def write_input(path: Path, n: int, vocab: int, seed: int = 11) -> dict:
    rng = np.random.default_rng(seed)
    dup_every = 100  # 1 % of the rows reuse an earlier row's id
    tokens = chats = dups = 0
    with path.open("w") as f:
        for i in range(n):
            rid = f"r{i}"
            if i >= dup_every and i % dup_every == 0:
                rid, dups = f"r{int(rng.integers(0, i))}", dups + 1
            if i % 2:
                k = int(round(math.exp(rng.uniform(math.log(16), math.log(512)))))
                tokens += k
                row = {"id": rid, "input_ids": rng.integers(0, vocab, size=k).tolist()}
            else:
                q = " ".join(rng.choice(WORDS, size=int(rng.integers(4, 40))))
                a = " ".join(rng.choice(WORDS, size=int(rng.integers(4, 80))))
                row = {"id": rid, "messages": [{"role": "user", "content": q}, {"role": "assistant", "content": a}]}
                chats += 1
            f.write(json.dumps(row) + "\n")
    return {"rows": n, "chat_rows": chats, "pre_tokenized_rows": n - chats, "duplicate_rows": dups}


def rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # peak so far; kB on Linux


def current_rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def child(input_path: str, out_dir: str) -> None:
    """One measurement in this fresh process; prints one JSON line."""
    import ray

    from conf.schema import load_config
    from pipeline.driver import job
    from pipeline.driver.plan import make_plan
    from pipeline.format.storage import Store

    cfg = load_config(ROOT / "conf" / "default.yaml", [f"input.path={input_path}", f"output.path={out_dir}"])
    ray.init(num_cpus=2, object_store_memory=2 * 2**30, include_dashboard=False, log_to_driver=False)
    import ray.data  # noqa: F401 - part of what every driver holds before its first row

    baseline = current_rss_mb()
    try:
        t0 = time.monotonic()
        plan = make_plan(cfg, 0)
        tokenized = job.tokenized_dataset(cfg, plan).materialize()
        t_tok = time.monotonic()
        store = Store(out_dir)
        if hasattr(job, "decide_work"):  # this version: the ledger
            from pipeline.driver.work import decide_work, still_to_do

            work = decide_work(tokenized, store, cfg.extract.turns, cfg.plan)
            todo = still_to_do(tokenized, work.skip)
            samples, dup_samples, rows = work.samples, work.duplicate_samples, work.rows
        else:  # the driver before the ledger: index in driver memory, sets in the filter
            index = job.index_of(tokenized)
            work = job._decide_work(cfg, plan, store, index)
            todo = job._still_to_do(tokenized, set(work.duplicates), work.done)
            samples, dup_samples, rows = index.num_rows, work.duplicate_samples, work.rows
        t_plan = time.monotonic()
        filtered = todo.count()
        t_end = time.monotonic()
    finally:
        ray.shutdown()
    assert filtered == rows, (filtered, rows)
    print(
        json.dumps(
            {
                "samples": samples,
                "duplicate_samples": dup_samples,
                "to_do": rows,
                "read_tokenize_s": round(t_tok - t0, 1),
                "dedup_and_resume_plan_s": round(t_plan - t_tok, 1),
                "filter_s": round(t_end - t_plan, 1),
                "plan_s": round(t_end - t0, 1),
                "driver_peak_rss_mb": round(rss_mb()),
                "driver_rss_after_imports_and_ray_init_mb": round(baseline),
            }
        )
    )


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, nargs="+", default=[100_000, 300_000, 1_000_000])
    ap.add_argument("--code", type=Path, default=ROOT, help="checkout whose job is measured (default: this one)")
    ap.add_argument("--label", default="this checkout")
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "plan_scale_cpu.json")
    ap.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child(*args.child)
        return

    from bench.bench_throughput import machine
    from pipeline.intake.model import DEFAULT_MODEL, resolve_model, vocab_size

    vocab = vocab_size(Path(resolve_model(DEFAULT_MODEL)))
    result = json.loads(args.out.read_text()) if args.out.exists() else {}
    result.update(
        benchmark="planning at scale: read, tokenize, dedup, resume filter (fresh output); driver peak RSS",
        date=datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d"),
        machine=machine(),
        target="driver peak RSS <= 2 GB at 1,000,000 rows, time no worse than linear",
    )
    runs = result.setdefault("runs", {}).setdefault(args.label, {})
    env = dict(os.environ, PYTHONPATH=str(args.code), HH_BENCH_CODE=str(args.code), RAY_USAGE_STATS_ENABLED="0")
    for n in args.rows:
        with tempfile.TemporaryDirectory() as tmp:
            path = Path(tmp) / "input.jsonl"
            made = write_input(path, n, vocab)
            cmd = [sys.executable, str(Path(__file__).resolve()), "--child", str(path), str(Path(tmp) / "out")]
            proc = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=str(args.code))
            if proc.returncode:
                raise SystemExit(proc.stderr[-4000:])
            figures = json.loads(proc.stdout.strip().splitlines()[-1])
        runs[str(n)] = made | figures
        # The other checkout's place on this machine is no part of the result.
        argv = ["OTHER_CHECKOUT" if a == str(args.code) and args.code != ROOT else a for a in sys.argv[1:]]
        runs[str(n)]["command"] = shlex.join(["python", "bench/bench_plan_scale.py", *argv])
        print(json.dumps({args.label: {n: runs[str(n)]}}), flush=True)
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()

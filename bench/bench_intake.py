"""Reading and indexing rows given as token ids: the work per core, and what Ray's step adds around it.

  python bench/bench_intake.py [--rows 640] [--min-len 64] [--max-len 6144] [--out bench/results/intake_cpu.json]

Rows `{"id", "input_ids"}` with log-uniform lengths (fixed seed), token ids below the default model's
vocabulary. Measured in one run:
1. per core, in this process: the read stage (read_lines: bytes to lines) and the tokenize stage (TokenizeLines
   on the read rows: JSON, checks, Arrow), each the best of three, in tokens per second;
2. the job's step as the driver runs it (tokenized_dataset(...).materialize(), on a local Ray),
   once on a fresh Ray (what a run pays: its workers start and import; also with the tokenize actors loading
   the tokenizer, as before the driver passed its size), then for --rows rows and for four
   times as many: the wall clock of each, the marginal rate between them, and the fixed cost (actor start,
   Ray's scheduling) that the marginal rate leaves.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import math
import shlex
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.bench_throughput import machine  # noqa: E402
from bench.timing import best_wall_s  # noqa: E402


def write_rows(path: Path, n: int, lo: int, hi: int, vocab: int, seed: int = 5) -> int:
    rng = np.random.default_rng(seed)
    tokens = 0
    with path.open("w") as f:
        for i in range(n):
            k = int(round(math.exp(rng.uniform(math.log(lo), math.log(hi)))))
            tokens += k
            f.write(json.dumps({"id": f"r{i}", "input_ids": rng.integers(0, vocab, size=k).tolist()}) + "\n")
    return tokens


def per_core(path: Path, tokens: int, model_dir: str, vocab: int) -> dict:
    import pyarrow as pa

    from pipeline.intake.read import read_lines
    from pipeline.intake.stage import TokenizeLines

    rows = read_lines({"path": str(path)})
    batch = pa.Table.from_pylist(rows)
    stage = TokenizeLines(model_dir=model_dir, max_tokens=1 << 20, overlength="truncate", vocab_size=vocab)
    read_s = best_wall_s(lambda: read_lines({"path": str(path)}), 3, warm_up=False)
    tok_s = best_wall_s(lambda: stage(batch), 3, warm_up=False)
    return {
        "read_tok_s": round(tokens / read_s),
        "tokenize_tok_s": round(tokens / tok_s),
        "read_and_tokenize_tok_s": round(tokens / (read_s + tok_s)),
        "tokenizer_loaded": stage.tokenize.tokenizer._tok is not None,
    }


def ray_step(path: Path, model_dir: str, tokenizer_size_known: bool = True) -> float:
    from conf.schema import load_config
    from pipeline.driver.job import tokenized_dataset
    from pipeline.driver.plan import make_plan

    cfg = load_config(
        ROOT / "conf" / "default.yaml", [f"input.path={path}", f"model.path={model_dir}", "extract.max_tokens=1048576"]
    )
    plan = make_plan(cfg, 0)
    if not tokenizer_size_known:  # as before the driver passed it: every tokenize actor loads the tokenizer
        plan = dataclasses.replace(plan, tokenizer_size=None)
    t0 = time.monotonic()
    rows = tokenized_dataset(cfg, plan).materialize().count()
    took = time.monotonic() - t0
    assert rows == sum(1 for _ in path.open()), "every row tokenized"
    return took


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=640)
    ap.add_argument("--min-len", type=int, default=64)
    ap.add_argument("--max-len", type=int, default=6144)
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "intake_cpu.json")
    args = ap.parse_args()

    import ray

    from pipeline.intake.model import DEFAULT_MODEL, resolve_model, vocab_size

    model_dir = str(resolve_model(DEFAULT_MODEL))
    vocab = vocab_size(Path(model_dir))
    result = {
        "benchmark": "rows given as token ids: read and tokenize per core, and the job's read-and-index step on Ray",
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d"),
        "command": shlex.join(["python", "bench/bench_intake.py"] + sys.argv[1:]),
        "machine": machine(),
        "target": "read and indexed at >= 2M tokens/s per core",
    }
    with tempfile.TemporaryDirectory() as tmp:
        small, large = Path(tmp) / "small.jsonl", Path(tmp) / "large.jsonl"
        n_small = write_rows(small, args.rows, args.min_len, args.max_len, vocab)
        n_large = write_rows(large, 4 * args.rows, args.min_len, args.max_len, vocab, seed=6)
        result["per_core"] = per_core(large, n_large, model_dir, vocab)
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
        try:
            before = ray_step(small, model_dir, tokenizer_size_known=False)
        finally:
            ray.shutdown()
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
        try:
            cold = ray_step(small, model_dir)  # a run's one step pays this: Ray's workers start and import
            walls = {n: ray_step(p, model_dir) for n, p in ((n_small, small), (n_large, large))}
        finally:
            ray.shutdown()
    (t1, w1), (t2, w2) = walls.items()
    marginal = (t2 - t1) / max(w2 - w1, 1e-9)
    result["ray_step"] = {
        "first_step_wall_s": round(cold, 3),
        "first_step_wall_s_tokenizer_loaded": round(before, 3),
        "rows": [args.rows, 4 * args.rows],
        "tokens": [t1, t2],
        "wall_s": [round(w1, 3), round(w2, 3)],
        "marginal_tok_s": round(marginal),
        "fixed_s": round(w1 - t1 / marginal, 3),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()

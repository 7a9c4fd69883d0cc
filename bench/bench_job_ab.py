"""One job from two checkouts of the project, alternated on one machine: what a change does to the job.

  python bench/bench_job_ab.py --work DIR --tokenizer TOKENIZER_DIR --tree before=DIR_A --tree after=DIR_B
                               [--rounds 2] [--shape qwen3-8b] [--prompts 640] [--min-len 64] [--max-len 8192]
                               [--lengths loguniform] [--device cuda] [--out bench/results/job_ab.json]

A checkout is any directory holding the project's files at some revision (`git archive REV | tar x -C DIR`).
The model and prompts are bench_job_gpu.py's (the same shapes, seeds and files under --work); each round runs
the job once from every checkout, in turn, with every engine default, and the order flips each round so that
a card warming up or a disk filling up weighs on both alike. Two runs on different machines differ by more
than most changes do (the 8k long-tailed mix's five H100 runs spread 0.933-0.955 against their own bare
engine); alternated on one machine, the difference is the change's.

Per run: the job's rate after engine start, the device's us per padded token, and the run's tail taken apart
from the engine's counters: the engine's last results -> the last batch's last capture taken -> its samples
encoded and written -> its files committed, with the shards' write rate (encoded bytes over the seconds in the
Parquet writer's writes). No bare engine runs here: the ratio is after / before, both jobs measured alike.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.bench_job_gpu import job, log, start_run  # noqa: E402 - after the path that makes `bench` importable


def tail(result: dict) -> dict:
    """The run's end taken apart (bench_job_gpu.window's split for its one actor), with the shards' write rate."""
    (w,) = result["window"].values()
    io = w.get("shard_io") or {}
    return {
        "captured_after_s": w["last_batch_captured_after_results_s"],
        "encoded_after_s": w["last_batch_encoded_after_results_s"],
        "committed_after_s": w["last_commit_after_results_s"],
        "write_gb_s": round(io["bytes"] / io["write_s"] / 1e9, 3) if io.get("write_s") else None,
    }


def summary(runs: list[dict], names: list[str]) -> dict:
    out = {}
    for name in names:
        mine = [r for r in runs if r["tree"] == name]
        out[name] = {
            "tok_s_median": statistics.median(r["tok_s"] for r in mine),
            "tail_s_median": statistics.median(r["tail"]["committed_after_s"] for r in mine),
            "us_per_padded_token_median": statistics.median(r["us_per_padded_token"] for r in mine),
        }
    first, *rest = names
    for name in rest:
        out[name]["tok_s_ratio_to_" + first] = round(out[name]["tok_s_median"] / out[first]["tok_s_median"], 4)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--work", type=Path, required=True)
    ap.add_argument("--tokenizer", type=Path, required=True)
    ap.add_argument("--tree", action="append", required=True, metavar="NAME=DIR", help="a checkout (two or more)")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--shape", default="qwen3-8b")
    ap.add_argument("--prompts", type=int, default=640)
    ap.add_argument("--min-len", type=int, default=64)
    ap.add_argument("--max-len", type=int, default=8192)
    ap.add_argument("--lengths", choices=("uniform", "loguniform"), default="loguniform")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "job_ab.json")
    args = ap.parse_args()

    trees: dict[str, Path] = {}
    for spec in args.tree:
        name, sep, path = spec.partition("=")
        tree = Path(path).resolve()
        if not sep or not name or name in trees:
            ap.error(f"--tree {spec!r}: NAME=DIR, each NAME once")
        if not (tree / "conf" / "default.yaml").is_file() or not (tree / "pipeline" / "cli.py").is_file():
            ap.error(
                f"--tree {spec!r}: {tree} is not a checkout of the project (no conf/default.yaml, pipeline/cli.py)"
            )
        trees[name] = tree
    if len(trees) < 2:
        ap.error("--tree: two checkouts or more")

    model_dir, prompts_path, _, result = start_run(
        args, "the same job from two checkouts of the project, alternated on one machine"
    )
    result |= {
        "trees": list(trees),
        "runs": [],
    }
    names = list(trees)
    for rnd in range(args.rounds):
        for name in names if rnd % 2 == 0 else names[::-1]:
            r = job(
                args.work,
                model_dir,
                prompts_path,
                1,
                None,
                args.device,
                None,
                None,
                max_tokens=max(4096, args.max_len),  # as bench_job_gpu.py: its runs and these compare
                verify=False,
                tree=trees[name],
            )
            if r.get("failed"):
                raise SystemExit(f"the job from {name} failed ({r['returncode']}):\n{r['log_tail']}")
            run = {
                "tree": name,
                "round": rnd,
                "tok_s": r["tok_s"],
                "us_per_padded_token": r["us_per_padded_token"][0],
                "tail": tail(r),
                "startup": r["startup"],
                "command": r["command"],
            }
            result["runs"].append(run)
            log(f"round {rnd} {name}: {run['tok_s']:,.0f} tok/s after engine start, tail {run['tail']}")
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(json.dumps(result, indent=2) + "\n")  # a run cut short keeps what it measured
    result["summary"] = summary(result["runs"], names)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result["summary"]))


if __name__ == "__main__":
    main()

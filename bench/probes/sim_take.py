"""The hf engine's batching (actors/hf/batching.take_batch, the real one) simulated on the job's request pattern: padding
and forward count for settings of max_padding and min_fill, no model and no device.

  python bench/probes/sim_take.py [--prompts 1280] [--min-len 128] [--max-len 2048] [--batch-size 128] [--calls 8]
                           [--max-batch-tokens 65536] [--seeds 0,1,2] [--out bench/results/take_simulation.json]

The job's pattern: `--calls` caller batches of `--batch-size` requests are in flight (engine.batches_per_actor),
each with its own order; a finished caller batch is replaced by the next. The host takes the next forward
while the current one runs; a forward lasts its padded tokens / a fixed rate, so the device's time is the
padded token count. Lengths are uniform (or log-uniform) in [min-len, max-len] with numpy's default_rng(seed).

What a forward costs on a device: with --host-ms and --device-us each forward lasts
max(padded tokens x device-us, host-ms): the host needs about the same time to launch a forward of any size
(bench/results/forward_gap_h200.json: ~120-180 ms for a 36-layer 8B decoder from transformers), so a forward
whose device time is shorter leaves the device waiting on the host. `seconds` is that sum.

What-if head rules (--head-batches, simulation only): the engine takes each forward's head (the longest
request, which sets the padded length) from the oldest caller batch; k takes it from the oldest k batches,
`all` from the whole pool (plain longest-first). Each run also says how many caller batches completed in
the run's last three forwards: batches that complete together commit together while the device has nothing
left (on a dataset larger than the batches in flight, it idles through their commits).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shlex
import sys
from concurrent.futures import Future
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import actors.hf.engine as hf  # noqa: E402
from actors.hf.batching import BatchPolicy, take_batch  # noqa: E402


def take_head_from(pool: list, policy: BatchPolicy, head_batches: int) -> list:
    """take_batch with its head taken from the oldest `head_batches` caller batches instead of the oldest one."""
    if head_batches <= 1:
        return take_batch(pool, policy)
    orders = sorted({r.order for r in pool})[:head_batches]
    head = max((r for r in pool if r.order in orders), key=lambda r: len(r.ids))
    order, head.order = head.order, float("-inf")  # take_batch heads with the oldest batch's longest: this one
    try:
        return take_batch(pool, policy)
    finally:
        head.order = order


def simulate(
    lengths: list[int],
    batch_size: int,
    calls: int,
    policy: BatchPolicy,
    host_ms: float = 0.0,
    device_us: float = 0.0,
    head_batches: int = 1,
) -> dict:
    batches = [lengths[i : i + batch_size] for i in range(0, len(lengths), batch_size)]
    pool: list[hf._Request] = []
    left: dict[int, int] = {}
    submitted = 0

    def submit() -> None:
        nonlocal submitted
        b, submitted = submitted, submitted + 1
        left[b] = len(batches[b])
        pool.extend(hf._Request(f"{b}:{j}", [1] * n, Future(), 0.0, float(b)) for j, n in enumerate(batches[b]))

    for _ in range(min(calls, len(batches))):
        submit()
    padded = forwards = 0
    seconds = 0.0
    last_forward: dict[int, int] = {}  # caller batch -> the forward its last request ran in
    running: list[hf._Request] = []
    while pool or running:
        nxt = take_head_from(pool, policy, head_batches) if pool else []  # taken while the current forward runs
        for r in running:  # the current forward ends: its caller batches may complete
            b = int(r.order)
            left[b] -= 1
            if left[b] == 0 and submitted < len(batches):
                submit()
        if nxt:
            for r in nxt:
                last_forward[int(r.order)] = forwards
            padded += len(nxt[0].ids) * len(nxt)
            forwards += 1
            seconds += max(len(nxt[0].ids) * len(nxt) * device_us / 1e6, host_ms / 1000)
        running = nxt
    out = {
        "padding": round(padded / sum(lengths) - 1, 4),
        "forwards": forwards,
        "batches_completing_in_last_3_forwards": sum(f >= forwards - 3 for f in last_forward.values()),
    }
    if device_us:
        out |= {"seconds": round(seconds, 2), "tok_s": round(sum(lengths) / seconds, 1)}
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompts", type=int, default=1280)
    ap.add_argument("--min-len", type=int, default=128)
    ap.add_argument("--max-len", type=int, default=2048)
    ap.add_argument("--batch-size", type=int, default=128)
    ap.add_argument("--calls", type=int, default=8)
    ap.add_argument("--max-batch-tokens", type=int, default=65536)
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--lengths", choices=("uniform", "loguniform"), default="uniform")
    ap.add_argument("--host-ms", type=float, default=0.0, help="host time to launch one forward, any size")
    ap.add_argument("--device-us", type=float, default=0.0, help="device microseconds per padded token")
    ap.add_argument("--min-fills", default="0.25,0.125,0.0625")
    ap.add_argument("--max-paddings", default="0.03,0.02,0.015")
    ap.add_argument("--head-batches", default="1", help="comma separated: k (oldest k caller batches) or all")
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "take_simulation.json")
    args = ap.parse_args()

    seeds = [int(s) for s in args.seeds.split(",")]

    def draw(seed: int) -> list[int]:
        rng = np.random.default_rng(seed)
        if args.lengths == "loguniform":
            lo, hi = np.log(args.min_len), np.log(args.max_len)
            return [int(round(np.exp(x))) for x in rng.uniform(lo, hi, args.prompts)]
        return [int(x) for x in rng.integers(args.min_len, args.max_len + 1, args.prompts)]

    draws = {s: draw(s) for s in seeds}
    cost = {"host_ms": args.host_ms, "device_us": args.device_us}
    runs = []
    for max_padding in [float(x) for x in args.max_paddings.split(",")]:
        for min_fill in [float(x) for x in args.min_fills.split(",")]:
            policy = BatchPolicy(args.max_batch_tokens, max_padding, min_fill)
            for head in args.head_batches.split(","):
                k = args.prompts if head == "all" else int(head)
                per_seed = [
                    simulate(draws[s], args.batch_size, args.calls, policy, **cost, head_batches=k) for s in seeds
                ]
                runs.append(
                    {"max_padding": max_padding, "min_fill": min_fill, "head_batches": head, "per_seed": per_seed}
                )
    # The bare engine's pattern: every request at once, one order.
    bare = [simulate(draws[s], args.prompts, 1, BatchPolicy(args.max_batch_tokens, 0.03, 0.125), **cost) for s in seeds]
    result = {
        "benchmark": "take_batch simulated on the job's request pattern (no model, no device)",
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d"),
        "machine": f"{platform.machine()}, {os.cpu_count()} cores (a simulation: no model, no device)",
        "command": shlex.join(["python", "bench/probes/sim_take.py"] + sys.argv[1:]),
        "pattern": {
            k: getattr(args, k)
            for k in ("prompts", "min_len", "max_len", "lengths", "batch_size", "calls", "max_batch_tokens")
        },
        "seeds": seeds,
        "cost_model": cost if args.device_us else None,
        "job_pattern": runs,
        "bare_pattern_max_padding_0.03_min_fill_0.125": bare,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    for r in runs:
        print(
            r["max_padding"],
            r["min_fill"],
            r["head_batches"],
            [
                (p["padding"], p["forwards"], p["batches_completing_in_last_3_forwards"], p.get("tok_s"))
                for p in r["per_seed"]
            ],
        )
    print("bare pattern", [(p["padding"], p["forwards"], p.get("tok_s")) for p in bare])


if __name__ == "__main__":
    main()

"""Why does a forward of a shape the process has not run before cost more? (issue: the job's forwards on the GPU
took 34.4 us per padded token against the bare loop's 29.1, every job forward having a new shape.)

Runs the same long-tailed prompt set through a random-init transformers model on one GPU, batched by length up to
a token budget, in three ways, each twice over the same batches (pass 1: shapes new to the process, pass 2:
the same shapes again):
- exact: each batch padded to its longest prompt (as the job does): almost every forward a new shape;
- bucketed: the padded length rounded up to a multiple of --bucket tokens;
- warm: exact, after one warm-up forward at the largest shape (what an engine warm-up does today);
- contended: warm, while another Python thread of the process runs pure-Python work (as an actor's staging,
  validation and encoding threads do): the forward thread launches every kernel under the GIL.
Device time per forward is measured with CUDA events; the result is us per padded token and tok/s of real tokens.

    python bench/probes/bench_forward_shapes.py --out OUT/forward_shapes.json [--shape 8b|small]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time


def prompt_lengths(n: int, lo: int, hi: int, seed: int) -> list[int]:
    import numpy as np

    rng = np.random.default_rng(seed)
    return [int(x) for x in np.exp(rng.uniform(math.log(lo), math.log(hi), n)).round()]


def batches(lengths: list[int], budget: int) -> list[tuple[int, int]]:
    """(rows, padded length) of each forward: longest first, as many as fit the token budget."""
    out, todo = [], sorted(lengths, reverse=True)
    while todo:
        t = todo[0]
        rows = max(1, budget // t)
        out.append((len(todo[:rows]), t))
        todo = todo[rows:]
    return out


def bucketed(plan, bucket: int, budget: int):
    """The same forwards with the padded length rounded up to a multiple of `bucket` (rows unchanged)."""
    return [(rows, -(-t // bucket) * bucket) for rows, t in plan]


def run_pass(model, plan, vocab: int):
    import torch

    times = []
    for rows, t in plan:
        ids = torch.randint(0, vocab, (rows, t), device="cuda")
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        with torch.inference_mode():
            model.model(input_ids=ids)
        end.record()
        times.append((start, end))
    torch.cuda.synchronize()
    return [s.elapsed_time(e) / 1e3 for s, e in times]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--shape", default="8b")
    ap.add_argument("--prompts", type=int, default=640)
    ap.add_argument("--budget", type=int, default=16384)
    ap.add_argument("--bucket", type=int, default=256)
    ap.add_argument("--modes", default="exact,bucketed,warm")
    # Python's GIL switch interval (s) for the contended mode: how long the forward thread may wait per launch.
    ap.add_argument("--switch-interval", type=float, default=None)
    args = ap.parse_args()

    import sys

    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    if args.switch_interval:
        sys.setswitchinterval(args.switch_interval)

    dims = {
        "8b": dict(hidden_size=4096, intermediate_size=12288, num_hidden_layers=36, num_attention_heads=32),
        "small": dict(hidden_size=1024, intermediate_size=3072, num_hidden_layers=8, num_attention_heads=16),
    }[args.shape]
    cfg = Qwen3Config(**dims, num_key_value_heads=8, head_dim=128, vocab_size=49152, max_position_embeddings=8192)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = Qwen3ForCausalLM(cfg).to(torch.bfloat16).eval()
    lengths = prompt_lengths(args.prompts, 64, 6144, seed=1)
    exact = batches(lengths, args.budget)
    real = sum(lengths)
    result = {
        "benchmark": "device time per forward: exact padded shapes vs bucketed shapes vs one warm-up forward",
        "machine": torch.cuda.get_device_name(0),
        "date": time.strftime("%Y-%m-%d"),
        "alloc_conf": os.environ.get("PYTORCH_CUDA_ALLOC_CONF", ""),
        "switch_interval_s": sys.getswitchinterval(),
        "model": {"family": "qwen3", **dims, "num_key_value_heads": 8, "weights": "random init, bf16"},
        "prompts": {"count": len(lengths), "tokens": real, "min": min(lengths), "max": max(lengths)},
        "budget_tokens": args.budget,
        "modes": {},
    }
    for mode in args.modes.split(","):
        plan = bucketed(exact, args.bucket, args.budget) if mode == "bucketed" else exact
        stop = None
        if mode == "contended":
            import threading

            stop = threading.Event()

            def spin(stop=stop):
                while not stop.is_set():
                    sum(i * i for i in range(10000))

            threading.Thread(target=spin, daemon=True).start()
        if mode in ("warm", "contended"):
            rows, t = max(exact, key=lambda p: p[0] * p[1])
            run_pass(model, [(rows, t)], cfg.vocab_size)
        padded = sum(r * t for r, t in plan)
        passes = []
        for _ in range(2):
            secs = run_pass(model, plan, cfg.vocab_size)
            total = sum(secs)
            passes.append(
                {
                    "device_s": round(total, 3),
                    "us_per_padded_token": round(1e6 * total / padded, 2),
                    "real_tok_s": round(real / total, 1),
                }
            )
        if stop is not None:
            stop.set()
        result["modes"][mode] = {
            "forwards": len(plan),
            "distinct_shapes": len(set(plan)),
            "padded_tokens": padded,
            "padding": round(padded / real - 1, 4),
            "pass1": passes[0],
            "pass2": passes[1],
        }
        print(mode, json.dumps(result["modes"][mode]), flush=True)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()

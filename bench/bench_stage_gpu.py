"""The hf engine's capture staging (HFEngine._stage) against the per-token byte split it replaced.

  python bench/bench_stage_gpu.py [--device cuda|cpu] [--hidden 4096] [--out bench/results/stage_gpu.json]

Random bf16 states of 3 aux layers and the final norm, [B, T, H], for a few batch shapes of about 64k and
32k padded tokens (lengths within 5 % of T). `stage`: the engine's method (one transpose per layer of the
whole batch, then a copy of whole rows per request) including its pinned copy on CUDA, which runs on a side
stream and is not timed. `per_token_split`: the method before it (per request, the aux layers concatenated,
then the bytes of each token split into the two planes), with the same non-finite count. Device time with CUDA events (wall time on a CPU),
best of 5; both must give the same bytes.
"""

from __future__ import annotations

import argparse
import datetime
import json
import shlex
import sys
import time
from concurrent.futures import Future
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def per_token_split(aux, last, lengths):
    """The staging before this one, kept here as the baseline: the same bytes, token by token."""
    import torch

    h, w = last.shape[-1], len(aux) * last.shape[-1]
    offsets = np.concatenate([[0], np.cumsum([2 * n * (w + h) for n in lengths])]).astype(np.int64)
    staging = torch.empty(int(offsets[-1]), dtype=torch.uint8, device=last.device)
    bad = (~torch.isfinite(last)).sum(-1, dtype=torch.int32)  # the non-finite count, as _stage does
    for a in aux:
        bad += (~torch.isfinite(a)).sum(-1, dtype=torch.int32)
    for row, n in enumerate(lengths):
        o = int(offsets[row])
        cols = torch.cat([a[row, :n] for a in aux], dim=-1)
        for part, width in ((cols, w), (last[row, :n], h)):
            staging[o : o + 2 * n * width].view(2, width, n).copy_(part.contiguous().view(torch.uint8).view(n, width, 2).permute(2, 1, 0))
            o += 2 * n * width
    return staging


def timed(fn, cuda: bool, repeats: int = 5) -> float:
    """Best of `repeats`, in ms (device time on CUDA)."""
    import torch

    fn()
    best = float("inf")
    for _ in range(repeats):
        if cuda:
            torch.cuda.synchronize()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            best = min(best, start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            best = min(best, (time.perf_counter() - t0) * 1000)
    return round(best, 2)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "stage_gpu.json")
    args = ap.parse_args()

    import torch

    from actors.hf_engine import HFEngine, _Request

    cuda = args.device.startswith("cuda")
    h = args.hidden
    shapes = {}
    for t, b in ((2048, 32), (1024, 64), (512, 64)):
        rng = np.random.default_rng(0)
        lengths = sorted((int(x) for x in rng.integers(int(t * 0.95), t + 1, b)), reverse=True)
        lengths[0] = t
        gen = torch.Generator(device=args.device).manual_seed(0)
        aux = [torch.randn(b, t, h, generator=gen, device=args.device).to(torch.bfloat16) for _ in range(3)]
        last = torch.randn(b, t, h, generator=gen, device=args.device).to(torch.bfloat16)
        eng = HFEngine("unused", (0, 1, 2), device=args.device)  # _stage needs no model
        eng.cuda, eng._marks = cuda, {}
        if cuda:
            eng._copy_stream = torch.cuda.Stream()
        batch = [_Request(str(i), [1] * n, Future(), 0.0) for i, n in enumerate(lengths)]
        ids = np.ones((b, t), dtype=np.int64)

        def stage():
            eng._taken = {("aux", k): a for k, a in enumerate(aux)} | {("last", 0): last}
            return eng._stage(batch, ids)

        staged = stage()
        if cuda:
            torch.cuda.synchronize()
        body = np.asarray(staged[2].numpy() if hasattr(staged[2], "numpy") else staged[2])
        same = bool(np.array_equal(body, per_token_split(aux, last, lengths).cpu().numpy()))
        shapes[f"T{t}xB{b}"] = {"tokens": sum(lengths), "stage_ms": timed(stage, cuda),
                                "per_token_split_ms": timed(lambda: per_token_split(aux, last, lengths), cuda), "same_bytes": same}  # fmt: skip
        print(f"T{t}xB{b}", shapes[f"T{t}xB{b}"], flush=True)
    result = {
        "benchmark": "hf engine capture staging: HFEngine._stage vs the per-token byte split it replaced",
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d"),
        "command": shlex.join(["python", "bench/bench_stage_gpu.py"] + sys.argv[1:]),
        "machine": torch.cuda.get_device_name(0) if cuda else "cpu",
        "hidden_size": h,
        "aux_layers": 3,
        "shapes": shapes,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()

"""The hf engine's capture staging: the Triton kernel, the torch ops, and the per-token byte split before them.

  python bench/probes/bench_stage_gpu.py [--device cuda|cpu] [--hidden 4096] [--out bench/results/stage_gpu.json]

Random bf16 states of 3 aux layers and the final norm, [B, T, H], for a few batch shapes of about 64k and
32k padded tokens (lengths within 5 % of T). Three ways to the same bytes and non-finite counts
(actors/hf/staging.py): `triton` (one kernel launch per layer; CUDA only), `torch_ops` (one transpose per
layer of the whole batch, then a copy of whole rows per request), and `per_token_split` (the method before
those: per request, the aux layers concatenated, then each token's bytes split into the two planes). For
each: the device time (CUDA events; wall time on a CPU) and the host time to issue the work (what the
engine's forward thread spends), best of 5; all must give the same bytes.
"""

from __future__ import annotations

import argparse
import datetime
import json
import shlex
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))


def per_token_split(layers, lengths, offsets, staging, bad) -> None:
    """The staging before actors/hf/staging.py, kept here as the baseline: the same bytes, token by token."""
    import torch

    *aux, last = layers
    h, w = last.shape[-1], len(aux) * last.shape[-1]
    for x in layers:
        bad += (~torch.isfinite(x)).sum(-1, dtype=torch.int32)
    for row, n in enumerate(lengths):
        o = int(offsets[row])
        cols = torch.cat([a[row, :n] for a in aux], dim=-1)
        for part, width in ((cols, w), (last[row, :n], h)):
            staging[o : o + 2 * n * width].view(2, width, n).copy_(
                part.contiguous().view(torch.uint8).view(n, width, 2).permute(2, 1, 0)
            )
            o += 2 * n * width


def timed(fn, cuda: bool, repeats: int = 5) -> tuple[float, float]:
    """(device ms, host ms to issue it), best of `repeats` each; on a CPU both are the wall time."""
    import torch

    fn()
    device = host = float("inf")
    for _ in range(repeats):
        if cuda:
            torch.cuda.synchronize()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            t0 = time.perf_counter()
            fn()
            host = min(host, (time.perf_counter() - t0) * 1000)
            end.record()
            torch.cuda.synchronize()
            device = min(device, start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            device = host = min(host, (time.perf_counter() - t0) * 1000)
    return round(device, 2), round(host, 2)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "stage_gpu.json")
    args = ap.parse_args()

    import torch

    from actors.hf.staging import TritonStager, plane_offsets, stage_torch

    cuda = args.device.startswith("cuda")
    h = args.hidden
    methods = {"torch_ops": stage_torch, "per_token_split": per_token_split}
    if cuda:
        triton = TritonStager.checked(args.device)
        if triton is None:
            raise SystemExit("the Triton staging kernel is not usable here (see the warning above)")
        methods = {"triton": triton, **methods}
    shapes = {}
    for t, b in ((2048, 32), (1024, 64), (512, 64)):
        rng = np.random.default_rng(0)
        lengths = sorted((int(x) for x in rng.integers(int(t * 0.95), t + 1, b)), reverse=True)
        lengths[0] = t
        gen = torch.Generator(device=args.device).manual_seed(0)
        layers = [torch.randn(b, t, h, generator=gen, device=args.device).to(torch.bfloat16) for _ in range(4)]
        offsets = plane_offsets(lengths, 4, h)
        row = {"tokens": sum(lengths)}
        want = None
        for name, fill in methods.items():
            staging = torch.empty(int(offsets[-1]), dtype=torch.uint8, device=args.device)
            bad = torch.zeros((b, t), dtype=torch.int32, device=args.device)

            def run(fill=fill, staging=staging, bad=bad, layers=layers, lengths=lengths, offsets=offsets):
                bad.zero_()
                fill(layers, lengths, offsets, staging, bad)

            device_ms, host_ms = timed(run, cuda)
            got = (staging.cpu(), bad.cpu())
            want = want or got
            row[name] = {
                "device_ms": device_ms,
                "host_ms": host_ms,
                "same_bytes": bool(torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])),
            }
            del staging, bad
        shapes[f"T{t}xB{b}"] = row
        print(f"T{t}xB{b}", row, flush=True)
    result = {
        "benchmark": "hf engine capture staging (actors/hf/staging.py): Triton kernel, torch ops, per-token byte split",
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d"),
        "command": shlex.join(["python", "bench/probes/bench_stage_gpu.py"] + sys.argv[1:]),
        "machine": torch.cuda.get_device_name(0) if cuda else "cpu",
        "hidden_size": h,
        "aux_layers": 3,
        "shapes": shapes,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()

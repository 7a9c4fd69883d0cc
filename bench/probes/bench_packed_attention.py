"""One decoder layer's attention, padded against packed, on the forwards a job really runs.

  python bench/probes/bench_packed_attention.py [--lengths loguniform|uniform] [--min-len 64] [--max-len 6144]
                                         [--prompts 640] [--batch-tokens 16384] [--heads 32/8] [--head-dim 128]
                                         [--out bench/results/packed_attention.json]

The prompts' lengths (the GPU benchmark's mixes, same seed) are cut into forwards twice: padded rows as the hf
engine takes them (actors/hf/batching.take_batch, every forward filled) and packed rows (take_packed). For each
forward, random bf16 query/key/value of the model's heads go through:

- padded: torch's scaled_dot_product_attention [B, H, T, D] as transformers calls it (GQA, causal, no mask),
  with torch's own choice of kernel and with each kernel forced (flash, cuDNN, memory-efficient);
- packed [N, H, D] over the cumulative lengths: FlashAttention-2 (`aten._flash_attention_forward`, what
  actors/hf/packing.py calls) and cuDNN (`aten._cudnn_attention_forward`).

It reports device microseconds per real token for each (CUDA events, best of 3 after a warm-up) and, for the
packed kernels, the largest difference from the padded output on real tokens. It says which attention kernel
packing should call, and how much of a packed forward's time attention is not.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import platform
import sys
from concurrent.futures import Future
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))


def lengths_of(n: int, lo: int, hi: int, kind: str) -> list[int]:
    """The GPU benchmark's prompt lengths: its generator and seed (the same draws for log-uniform lengths)."""
    from bench.bench_job_gpu import prompt_lengths

    return prompt_lengths(np.random.default_rng(1234), n, lo, hi, kind)


def forwards(lengths: list[int], batch_tokens: int, packed: bool) -> list[list[int]]:
    from actors.hf.batching import BatchPolicy, take_batch, take_packed
    from actors.hf.engine import _Request

    pool = [_Request(str(i), [0] * n, Future(), 0.0, float(i // 128)) for i, n in enumerate(lengths)]
    out = []
    while pool:
        batch = take_packed(pool, batch_tokens) if packed else take_batch(pool, BatchPolicy(batch_tokens, min_fill=1.0))
        out.append([len(r.ids) for r in batch])
    return out


def timed(fn, repeats: int = 3) -> float:
    import torch

    fn()
    best = float("inf")
    for _ in range(repeats):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        best = min(best, a.elapsed_time(b) / 1000)
    return best


def main() -> None:
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    ap = argparse.ArgumentParser()
    ap.add_argument("--lengths", choices=("uniform", "loguniform"), default="loguniform")
    ap.add_argument("--min-len", type=int, default=64)
    ap.add_argument("--max-len", type=int, default=6144)
    ap.add_argument("--prompts", type=int, default=640)
    ap.add_argument("--batch-tokens", type=int, default=16384)
    ap.add_argument("--heads", default="32/8")
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "packed_attention.json")
    args = ap.parse_args()
    hq, hkv = (int(x) for x in args.heads.split("/"))
    d, dev = args.head_dim, "cuda"
    lengths = lengths_of(args.prompts, args.min_len, args.max_len, args.lengths)
    real = sum(lengths)
    scale = d**-0.5
    gen = torch.Generator(device=dev).manual_seed(0)

    def qkv(rows: int, t: int):
        return [torch.randn(rows, h, t, d, device=dev, dtype=torch.bfloat16, generator=gen) for h in (hq, hkv, hkv)]

    padded_forwards = forwards(lengths, args.batch_tokens, packed=False)
    padded_s: dict[str, float] = {}
    for name, backend in (
        ("sdpa_default", None),
        ("sdpa_flash", SDPBackend.FLASH_ATTENTION),
        ("sdpa_cudnn", SDPBackend.CUDNN_ATTENTION),
        ("sdpa_efficient", SDPBackend.EFFICIENT_ATTENTION),
    ):
        total = 0.0
        try:
            for rows in padded_forwards:
                q, k, v = qkv(len(rows), rows[0])

                def run(q=q, k=k, v=v, backend=backend):
                    with sdpa_kernel(backend) if backend is not None else contextlib.nullcontext():
                        F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=True)

                total += timed(run)
            padded_s[name] = total
        except Exception as e:  # noqa: BLE001 - a kernel this device or torch lacks is a row with its reason
            padded_s[name] = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"

    packed_s: dict[str, float | str] = {}
    max_diff: dict[str, float] = {}
    packed_forwards = forwards(lengths, args.batch_tokens, packed=True)
    for name in ("flash_varlen", "cudnn_varlen"):
        total, worst = 0.0, 0.0
        try:
            for rows in packed_forwards:
                n = sum(rows)
                cu = torch.tensor(np.concatenate([[0], np.cumsum(rows)]), dtype=torch.int32, device=dev)
                q, k, v = (x[0].transpose(0, 1) for x in qkv(1, n))  # [N, H, D]
                longest = max(rows)
                if name == "flash_varlen":  # what actors/hf/packing.py calls

                    def run(q=q, k=k, v=v, cu=cu, longest=longest):
                        return torch.ops.aten._flash_attention_forward(
                            q, k, v, cu, cu, longest, longest, 0.0, True, False, scale=scale
                        )[0]
                else:

                    def run(q=q, k=k, v=v, cu=cu, longest=longest):
                        return torch.ops.aten._cudnn_attention_forward(
                            q, k, v, None, cu, cu, longest, longest, False, 0.0, True, False, scale=scale
                        )[0]

                total += timed(run)
                # Against the padded kernel on the first sequence of the row and the last one.
                got = run()
                for a, b in ((0, rows[0]), (n - rows[-1], n)):
                    want = F.scaled_dot_product_attention(
                        q[a:b].transpose(0, 1)[None],
                        k[a:b].transpose(0, 1)[None],
                        v[a:b].transpose(0, 1)[None],
                        is_causal=True,
                        scale=scale,
                        enable_gqa=True,
                    )[0].transpose(0, 1)
                    worst = max(worst, float((got[a:b].float() - want.float()).abs().max()))
            packed_s[name], max_diff[name] = total, worst
        except Exception as e:  # noqa: BLE001
            packed_s[name] = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"

    def us(x):
        return round(1e6 * x / real, 3) if isinstance(x, float) else x

    padded_tokens = sum(len(r) * r[0] for r in padded_forwards)
    result = {
        "benchmark": "bench_packed_attention",
        "machine": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "date": datetime.date.today().isoformat(),
        "command": "python " + " ".join(sys.argv),
        "mix": {
            "lengths": args.lengths,
            "prompts": args.prompts,
            "tokens": real,
            "padding": round(padded_tokens / real - 1, 4),
        },
        "heads": [hq, hkv, d],
        "forwards": {"padded": len(padded_forwards), "packed": len(packed_forwards)},
        "us_per_real_token": {
            **{f"padded/{k}": us(v) for k, v in padded_s.items()},
            **{f"packed/{k}": us(v) for k, v in packed_s.items()},
        },
        "packed_max_abs_diff_vs_sdpa": {k: round(v, 5) for k, v in max_diff.items()},
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()

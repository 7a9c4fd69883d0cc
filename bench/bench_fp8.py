"""output.encoding=fp8 against bf16 on the default model's real hidden states, in one run.

  python bench/bench_fp8.py --work DIR [--config conf/default.yaml] [--limit N] [--json bench/results/fp8_default_model.json]

1. The real job (`python -m pipeline.cli run`: Ray, the SGLang server with the hook, Parquet), twice over the
   same input: `output.encoding=planes_zstd` (lossless bf16) and `output.encoding=fp8` (quantized in the
   server). Each job's exact committed bytes (the manifest's, = the shard files' sizes) against raw bf16 =
   tokens x (aux layers + 1) x hidden x 2, and each job's rate after engine start (the manifest's).
2. Every token of every layer of every sample, the fp8 output's (dequantized by the reader) against the bf16
   output's states of the same sample: per-token cosine and the relative error of the per-token L2 norm;
   their distribution (min and low percentiles; mean) per layer.
3. The host's encode rate per thread for both encodings, on the same states (the body an engine hands the
   actor -> the stored value; what the writer does per sample): MB of raw bf16 per second.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from pipeline.format.codec import Codec, bits_to_float  # noqa: E402
from pipeline.format.manifest import read_manifest  # noqa: E402
from pipeline.format.shards import open_shards  # noqa: E402
from pipeline.format.storage import Store  # noqa: E402


def run_job(config: str, out: Path, encoding: str, input_path: Path | None) -> dict:
    if out.exists():
        shutil.rmtree(out)
    cmd = [sys.executable, "-m", "pipeline.cli", "run", config, "--set", f"output.path={out}"]
    cmd += ["--set", f"output.encoding={encoding}"]
    if input_path is not None:
        cmd += ["--set", f"input.path={input_path}"]
    load_before = os.getloadavg()[0]
    t0 = time.monotonic()
    subprocess.run(cmd, check=True, cwd=ROOT)
    wall = time.monotonic() - t0
    m = read_manifest(Store(str(out)))
    last = m.get("last_run", {})
    return {
        "encoding": encoding,
        "wall_s": round(wall, 1),
        # The job's rate means something only on an otherwise idle machine: the 1-minute load average
        # before it starts, and after it ends (the job itself brings it to about the core count).
        "load_avg_before_after": [round(load_before, 2), round(os.getloadavg()[0], 2)],
        "samples_ok": m["totals"]["samples_ok"],
        "tokens": m["totals"]["tokens"],
        "bytes": m["totals"]["bytes"],
        "tokens_per_second_after_engine_start": last.get("tokens_per_second_after_engine_start"),
        "hidden_size": m["hidden_size"],
        "aux_layers": m["aux_layers"],
    }


def _dist(x: np.ndarray) -> dict:
    return {
        "min": float(x.min()),
        "p0.1": float(np.percentile(x, 0.1)),
        "p1": float(np.percentile(x, 1)),
        "p50": float(np.percentile(x, 50)),
        "mean": float(x.mean()),
        "max": float(x.max()),
    }


def compare(bf16_out: Path, fp8_out: Path, h: int, names: list[str]) -> dict:
    want = {s["sample_id"]: s for s in open_shards(str(bf16_out), as_torch=False, final="stored")}
    cos: dict[str, list] = {n: [] for n in names}
    norm: dict[str, list] = {n: [] for n in names}
    for s in open_shards(str(fp8_out), as_torch=False, final="stored"):
        w = want.pop(s["sample_id"])
        assert np.array_equal(s["input_ids"], w["input_ids"])
        t = len(s["input_ids"])
        a = np.concatenate([s["aux_hidden_states"], s["last_hidden_state"]], axis=1)
        b = np.concatenate([w["aux_hidden_states"], w["last_hidden_state"]], axis=1)
        a = bits_to_float(a).astype(np.float64).reshape(t, -1, h)
        b = bits_to_float(b).astype(np.float64).reshape(t, -1, h)
        na, nb = np.linalg.norm(a, axis=-1), np.linalg.norm(b, axis=-1)
        c = (a * b).sum(-1) / (na * nb)
        for j, n in enumerate(names):
            cos[n].append(c[:, j])
            norm[n].append(np.abs(na[:, j] / nb[:, j] - 1))
    assert not want, f"{len(want)} samples of the bf16 output missing from the fp8 one"
    out = {}
    for n in names:
        c, r = np.concatenate(cos[n]), np.concatenate(norm[n])
        out[n] = {"tokens": int(c.size), "cosine": _dist(c), "norm_relative_error": _dist(r)}
    return out


def encode_rates(bf16_out: Path, h: int, seconds: float = 3.0) -> dict:
    samples = [s for _, s in zip(range(16), open_shards(str(bf16_out), as_torch=False, final="stored"))]
    rates = {}
    for encoding in ("planes_zstd", "fp8"):
        codec = Codec(encoding, 1, h)
        bodies = [
            (codec.body_from_bits(s["aux_hidden_states"]), codec.body_from_bits(s["last_hidden_state"]))
            for s in samples
        ]
        raw = sum(2 * (s["aux_hidden_states"].size + s["last_hidden_state"].size) for s in samples)
        n, t0 = 0, time.monotonic()
        while time.monotonic() - t0 < seconds:
            for aux, last in bodies:
                codec.encode(aux)
                codec.encode(last)
            n += 1
        rates[encoding] = round(n * raw / (time.monotonic() - t0) / 1e6, 1)
    return rates


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--work", type=Path, required=True)
    ap.add_argument("--config", default="conf/default.yaml")
    ap.add_argument("--limit", type=int, default=None, help="only the first N rows of the config's input")
    ap.add_argument("--json", type=Path, default=ROOT / "bench" / "results" / "fp8_default_model.json")
    args = ap.parse_args()
    args.work.mkdir(parents=True, exist_ok=True)
    input_path = None
    if args.limit:
        from conf import load_config

        lines = (ROOT / load_config(ROOT / args.config, []).input.path).read_text().splitlines()[: args.limit]
        input_path = args.work / "input.jsonl"
        input_path.write_text("\n".join(lines) + "\n")
    jobs = {e: run_job(args.config, args.work / e, e, input_path) for e in ("planes_zstd", "fp8")}
    h = jobs["fp8"]["hidden_size"]
    names = [f"aux layer {i}" for i in jobs["fp8"]["aux_layers"]] + ["final (pre-norm)"]
    raw = 2 * h * len(names) * jobs["fp8"]["tokens"]
    for j in jobs.values():
        j["of_raw_bf16"] = round(j["bytes"] / raw, 4)
    layers = compare(args.work / "planes_zstd", args.work / "fp8", h, names)
    rates = encode_rates(args.work / "planes_zstd", h)
    result = {
        "benchmark": "fp8 encoding against bf16, the default model's real hidden states through the real job",
        "command": "python bench/bench_fp8.py --work WORK" + (f" --limit {args.limit}" if args.limit else ""),
        "date": datetime.date.today().isoformat(),
        "machine": f"{os.cpu_count()}-core {platform.machine()} CPU ({platform.processor() or 'unknown'}), no GPU",
        "raw_bf16_bytes": raw,
        "jobs": jobs,
        "fp8_over_bf16_bytes": round(jobs["fp8"]["bytes"] / jobs["planes_zstd"]["bytes"], 4),
        "per_layer_fp8_vs_bf16": layers,
        "lowest_cosine_any_token_any_layer": min(d["cosine"]["min"] for d in layers.values()),
        "largest_norm_relative_error": max(d["norm_relative_error"]["max"] for d in layers.values()),
        "host_encode_mb_raw_per_s_one_thread": rates,
        "speed_ratio_fp8_over_bf16_job": (
            round(
                jobs["fp8"]["tokens_per_second_after_engine_start"]
                / jobs["planes_zstd"]["tokens_per_second_after_engine_start"],
                3,
            )
            if jobs["fp8"]["tokens_per_second_after_engine_start"]
            and jobs["planes_zstd"]["tokens_per_second_after_engine_start"]
            else None
        ),
    }
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps({k: v for k, v in result.items() if k != "per_layer_fp8_vs_bf16"}, indent=2))
    for n, d in layers.items():
        print(
            f"{n:>18}: cosine min {d['cosine']['min']:.6f} p0.1 {d['cosine']['p0.1']:.6f} mean {d['cosine']['mean']:.6f}; "
            f"norm rel. error max {d['norm_relative_error']['max']:.4f} mean {d['norm_relative_error']['mean']:.5f}"
        )


if __name__ == "__main__":
    main()

"""How long the hf engine's model load takes on a GPU, two ways, alternating, in one process.

  python bench/probes/bench_model_load_gpu.py --work DIR --tokenizer TOKENIZER_DIR [--shape 8b] [--repeats 2]
                                       [--out bench/results/model_load_gpu.json]

- host_then_device: the engine's load as it stands (actors/hf/decoder.py, Decoder.load): the whole model
  is read into host memory in bf16, then the decoder is moved to the device.
- device_map: the same call with `device_map=<device>`, so transformers places each tensor on the device as it
  reads it and the host copy of the model never exists.

Each load ends when the decoder's parameters are on the device and the device is idle; the model is freed
and the allocator's cache emptied between loads. The model files stay in the page cache after the first
load (a job's second start, and the bench's first load warms them); the first load is reported apart.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import platform
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from bench.bench_job_gpu import log, make_model  # noqa: E402 - after the path that makes `bench` importable


def load_once(model_dir: Path, how: str, device: str) -> float:
    import torch
    from transformers import AutoModelForCausalLM

    t0 = time.monotonic()
    extra = {"device_map": device} if how == "device_map" else {}
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16, attn_implementation="sdpa", **extra)
    base = model.get_decoder().to(device).eval()
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    took = time.monotonic() - t0
    where = {str(p.device) for p in base.parameters()}
    del model, base
    gc.collect()
    if device.startswith("cuda"):
        torch.cuda.empty_cache()
    log(f"{how}: {took:.2f}s (parameters on {sorted(where)})")
    return took


def parse_args(doc: str, out_name: str) -> argparse.Namespace:
    """The arguments of the engine-start benchmarks (this one and bench_engine_start_gpu)."""
    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--work", type=Path, required=True)
    ap.add_argument("--tokenizer", type=Path, required=True)
    ap.add_argument("--shape", default="8b")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--out", type=Path, default=ROOT / "bench/results" / out_name)
    return ap.parse_args()


def record_head(benchmark: str, script: str, args: argparse.Namespace, model_dir: Path) -> dict:
    """What every engine-start result opens with: the benchmark, machine, date, command and model."""
    import torch

    return {
        "benchmark": benchmark,
        "machine": f"1 x {torch.cuda.get_device_name()}" if args.device.startswith("cuda") else platform.processor(),
        "date": datetime.date.today().isoformat(),
        "command": f"python bench/{Path(script).name} " + " ".join(sys.argv[1:]),
        "torch": torch.__version__,
        "transformers": __import__("transformers").__version__,
        "shape": args.shape,
        "model_gb": round(sum(f.stat().st_size for f in model_dir.glob("*.safetensors")) / 1e9, 2),
    }


def main() -> None:
    args = parse_args(__doc__, "model_load_gpu.json")

    args.work.mkdir(parents=True, exist_ok=True)
    model_dir = make_model(args.work, args.shape, args.tokenizer, args.device)
    ways = ("host_then_device", "device_map")
    # The first load warms the page cache, so it is reported apart from the alternating ones.
    first = {"way": ways[0], "seconds": round(load_once(model_dir, ways[0], args.device), 2)}
    runs: dict[str, list] = {w: [] for w in ways}
    errors: dict[str, str] = {}
    for _ in range(args.repeats):
        for way in ways:
            if way in errors:
                continue
            try:
                runs[way].append(round(load_once(model_dir, way, args.device), 2))
            except Exception as e:  # noqa: BLE001 - a way this transformers cannot take is a result too
                errors[way] = f"{type(e).__name__}: {e}"
                log(f"{way}: {errors[way]}")
    out = record_head(
        "the hf engine's model load: host then device against device_map, alternating", __file__, args, model_dir
    ) | {
        "first_load": first,
        "seconds": runs,
        "best": {w: min(v) for w, v in runs.items() if v},
        "errors": errors,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=1) + "\n")
    log(f"wrote {args.out}")
    print(json.dumps({k: out[k] for k in ("first_load", "seconds", "best", "errors")}))


if __name__ == "__main__":
    main()

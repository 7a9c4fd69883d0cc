"""Where a fresh process's hf engine start goes on a GPU, and whether starting CUDA early shortens it.

  python bench/probes/bench_engine_start_gpu.py --work DIR --tokenizer TOKENIZER_DIR [--shape 8b] [--repeats 2]
                                         [--out bench/results/engine_start_gpu.json]

Each start is a new Python process, as an actor's is: it imports the engine, builds `HFEngine` with the job's
defaults and times `start()` to the end of its warm-up, by the engine's own phases (the import, reading the
model into host memory, moving it to the device, the packing and staging checks, the warm-up). Two ways,
alternating:
- as_is: the engine's start as it stands; the process's first CUDA call is the move to the device.
- cuda_early: a thread makes the first CUDA call (the context) as the process starts, so the context is built
  while transformers imports and the model is read on the host.
The model files are written and read once first, so every start reads them from the page cache.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from bench.bench_job_gpu import log, make_model  # noqa: E402 - after the path that makes `bench` importable
from bench.probes.bench_model_load_gpu import parse_args, record_head  # noqa: E402

CHILD = """
import json, sys, threading, time
t0 = time.monotonic()
import torch
if sys.argv[3] == "cuda_early":
    threading.Thread(target=lambda: torch.zeros(1, device=sys.argv[2]), daemon=True).start()
from actors.hf.engine import HFEngine
from pipeline.driver.plan import default_aux_layers

layers = json.load(open(sys.argv[1] + "/config.json"))["num_hidden_layers"]  # transformers stays unimported
engine = HFEngine(sys.argv[1], default_aux_layers(layers), device=sys.argv[2], max_batch_tokens=16384)
t1 = time.monotonic()
engine.start()
done = time.monotonic()
print(json.dumps({"process_s": round(done - t0, 3), "start_s": round(done - t1, 3), "phases": engine.phases}))
engine.close()
"""


def start_once(model_dir: Path, device: str, way: str) -> dict:
    proc = subprocess.run(
        [sys.executable, "-c", CHILD, str(model_dir), device, way], cwd=ROOT, capture_output=True, text=True
    )
    if proc.returncode != 0:
        raise RuntimeError(f"{way}: exit {proc.returncode}\n{proc.stderr[-2000:]}")
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    log(f"{way}: {json.dumps(got)}")
    return got


def main() -> None:
    args = parse_args(__doc__, "engine_start_gpu.json")

    args.work.mkdir(parents=True, exist_ok=True)
    model_dir = make_model(args.work, args.shape, args.tokenizer, args.device)
    ways = ("as_is", "cuda_early")
    first = start_once(model_dir, args.device, ways[0])  # reads the files into the page cache: reported apart
    runs: dict[str, list] = {w: [] for w in ways}
    for _ in range(args.repeats):
        for way in ways:
            runs[way].append(start_once(model_dir, args.device, way))
    out = record_head(
        "a fresh process's hf engine start on a GPU by part: as it stands, and with CUDA started early",
        __file__,
        args,
        model_dir,
    ) | {
        "first_start": first,
        "starts": runs,
        # From the process's first line: the early thread starts before start() is called.
        "best_process_s": {w: min(r["process_s"] for r in v) for w, v in runs.items()},
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=1) + "\n")
    log(f"wrote {args.out}")
    print(json.dumps(out["best_process_s"]))


if __name__ == "__main__":
    main()

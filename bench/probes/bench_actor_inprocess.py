"""The extractor stage in one process, without Ray, against the bare engine on the same prompts.

  python bench/probes/bench_actor_inprocess.py --model MODEL_DIR --prompts PROMPTS.jsonl --out-dir DIR
                                        [--engine hf|sglang] [--max-batch-tokens 65536] [--batch-size 128]
                                        [--calls 8] [--device cuda] [--json bench/results/actor_inprocess.json]

PROMPTS.jsonl: `{"id", "input_ids"}` per line (bench_job_gpu.py writes one), or `short:N`: bench_throughput's short
set (N prompts, seed 0). The same HiddenStateExtractor the
job runs (capture, validation, encoding, committed shards under DIR) is called on `--calls` threads at once,
as Ray Data calls it with engine.batches_per_actor, so the whole-job benchmark's loss can be split into
what the actor itself costs and what Ray adds. Both engines are warmed up first; the engine's own timing
(forward thread: forward, staging, idle) is reported with each rate.

--engine sglang (the CPU's engine): the SGLang capture engine with conf/default.yaml's settings (the server's
flags, engine.max_in_flight, engine.cpu_dtype); "bare" is then that engine capturing every prompt at once with
each dump released unread, and the stage runs with --calls extractor calls at once (the job's default on the CPU:
2 calls of 32). `--model default` is the embedded default model.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shlex
import shutil
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))


class _NoMetrics:
    """Ray's metrics need a Ray worker; this run has none."""

    def record(self, rows) -> None:
        pass


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", type=Path, required=True)
    ap.add_argument(
        "--prompts", required=True, help="a JSONL of {id, input_ids}, or short:N (bench_throughput's short set)"
    )
    ap.add_argument(
        "--out-dir", type=Path, required=True, help="where the extractor commits its shards (removed after)"
    )
    ap.add_argument("--max-batch-tokens", type=int, default=65536)
    ap.add_argument("--batch-size", type=int, default=128)
    ap.add_argument("--calls", type=int, default=8, help="extractor calls at once (engine.batches_per_actor)")
    ap.add_argument("--engine", choices=("hf", "sglang"), default="hf")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--json", type=Path, default=ROOT / "bench" / "results" / "actor_inprocess.json")
    args = ap.parse_args()

    import pyarrow as pa

    import actors.extractor as extractor
    from bench.bare_hf import BareHFEngine
    from conf import load_config
    from pipeline.driver.plan import default_aux_layers
    from pipeline.format.final_norm import read_final_norm
    from pipeline.format.shards import ShardLayout
    from pipeline.intake import model as model_lib

    extractor.ExtractorMetrics = _NoMetrics
    cfg = load_config(str(ROOT / "conf" / "default.yaml"), [])  # short:N's source text, sglang's settings
    if str(args.model) == "default":
        args.model = model_lib.prepare_default_model()
    if args.prompts.startswith("short:"):
        from bench.bench_throughput import job_tokenizer, short_set

        lines = (ROOT / cfg.input.path).read_text().splitlines()
        ids = short_set(job_tokenizer(cfg)[1], lines, int(args.prompts.split(":", 1)[1]), seed=0)
        prompts = [{"id": f"short-{i:04d}", "input_ids": x} for i, x in enumerate(ids)]
    else:
        prompts = [json.loads(line) for line in Path(args.prompts).open()]
    tokens = sum(len(p["input_ids"]) for p in prompts)
    aux = default_aux_layers(model_lib.num_hidden_layers(args.model))
    # The SGLang engine stores the final layer before the norm, as the job does (the hf bench: after it).
    final_norm = read_final_norm(args.model) if args.engine == "sglang" else None
    layout = ShardLayout(aux, model_lib.hidden_size(args.model), final_norm=final_norm)
    warm = [(f"w{i}", p["input_ids"]) for i, p in enumerate(prompts[:32])]
    result = {
        "benchmark": f"extractor stage in-process (no Ray) vs the bare {args.engine} engine, same prompts",
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d"),
        "command": shlex.join(["python", "bench/probes/bench_actor_inprocess.py"] + sys.argv[1:]),
        "prompts": len(prompts),
        "tokens": tokens,
        "max_batch_tokens": args.max_batch_tokens,
    }
    if args.device == "cuda":
        import torch

        result["machine"] = torch.cuda.get_device_name(0)
    else:
        from bench.bench_throughput import machine

        result["machine"] = machine()

    if args.engine == "sglang":
        from actors.sglang.engine import SGLangEngine

        cpu_threads = cfg.engine.cpu_threads or os.cpu_count() or 1
        engine_kwargs = SGLangEngine.kwargs_for(
            cfg.engine, str(args.model), aux, False, cpu_threads, layout.final_layer, layout.codec.layout
        )
        with SGLangEngine(**engine_kwargs) as bare:
            t0 = time.monotonic()
            for res in bare.capture([(p["id"], p["input_ids"]) for p in prompts]).values():
                assert res.error is None, res.error
                res.capture.release()
            result["bare"] = {"tok_s": round(tokens / (time.monotonic() - t0), 1), "engine": bare.stats()}
    else:
        engine_kwargs = dict(
            model_dir=str(args.model), aux_layers=aux, device=args.device, max_batch_tokens=args.max_batch_tokens
        )
        with BareHFEngine(**engine_kwargs) as bare:
            bare.capture(warm)
            bare.reset_stats()
            t0 = time.monotonic()
            bare.capture([(p["id"], p["input_ids"]) for p in prompts])
            result["bare"] = {"tok_s": round(tokens / (time.monotonic() - t0), 1), "engine": bare.stats()}
    print("bare", json.dumps(result["bare"]), flush=True)

    batches = [
        pa.Table.from_pylist(
            [
                {
                    "sample_id": p["id"],
                    "source": f"{Path(args.prompts).name}:{i + j + 1}",
                    "input_ids": p["input_ids"],
                    "loss_mask": [1] * len(p["input_ids"]),
                    "status": "ok",
                    "stage": "",
                    "reason": "",
                }
                for j, p in enumerate(prompts[i : i + args.batch_size])
            ]
        )
        for i in range(0, len(prompts), args.batch_size)
    ]
    shutil.rmtree(args.out_dir, ignore_errors=True)
    stage = extractor.HiddenStateExtractor(args.engine, engine_kwargs, layout, str(args.out_dir), retries=0)
    try:
        if args.engine == "hf":  # the SGLang engine warms itself up at start (its first pass is what a job gets)
            stage.engine.capture(warm)
            stage.engine.reset_stats()
        finished: list[float] = []
        t0 = time.monotonic()

        def call(batch):
            rows = stage(batch)
            finished.append(round(time.monotonic() - t0, 2))
            return rows

        with ThreadPoolExecutor(args.calls) as pool:
            rows = [r for t in pool.map(call, batches) for r in t.to_pylist()]
        seconds = time.monotonic() - t0
    finally:
        stage.close()
        shutil.rmtree(args.out_dir, ignore_errors=True)
    ok = sum(r["status"] == "ok" for r in rows)
    result["actor"] = {
        "tok_s": round(tokens / seconds, 1),
        "seconds": round(seconds, 2),
        "samples_ok": ok,
        "samples": len(prompts),
        "batches_done_at_s": sorted(finished),
        "engine": stage.engine.stats(),
    }
    result["ratio_vs_bare"] = round(result["actor"]["tok_s"] / result["bare"]["tok_s"], 3)
    print("actor", json.dumps(result["actor"]), flush=True)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(result, indent=2) + "\n")
    print(
        json.dumps(
            {k: result[k] for k in ("tokens", "ratio_vs_bare")}
            | {"bare_tok_s": result["bare"]["tok_s"], "actor_tok_s": result["actor"]["tok_s"]}
        )
    )


if __name__ == "__main__":
    main()

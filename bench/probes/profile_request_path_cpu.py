"""Where a request's time goes between a plain SGLang server and the job, on the CPU, in one run.

  python bench/probes/profile_request_path_cpu.py [--prompts 160] [--windows 4,8,16] [--skip-job]
                                           [--out bench/results/request_path_cpu.json]

The same short prompts (log-uniform 48-1,024 tokens, median ~250: bench/probes/bench_server_flags.py's set) go to:
  plain       `sglang.launch_server` as a user starts it on the CPU: SGLang's defaults plus what CPU mode needs
              (--device cpu --attention-backend torch_native --disable-cuda-graph, SGLANG_USE_CPU_ENGINE=1, the
              sgl_kernel stand-in) and --disable-radix-cache; no thread settings of ours. The baseline: its best
              window.
  project     the project's bare spec (ServerSpec(capture=False), bench/bench_throughput.py's old baseline).
  hook        the job's server (aux capture, the dump hook); the client deletes each dump unread.
  engine      the same server through SGLangEngine: dumps awaited, read and validated (check_capture).
  encode      engine + each sample encoded for its shard (Capture.encode on an encoder pool), no Parquet.
  job         `harvest run` on the prompts as pre-tokenized rows (Ray, the actor, shards): its manifest's rate
              from the moment the engine was up to the last result.
Each step's extra milliseconds per request against the plain server's best: (1/rate - 1/base) x mean tokens.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor, as_completed
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))
sys.path.insert(0, str(ROOT / "bench" / "probes"))

from bench_server_flags import prompts  # noqa: E402
from bench_throughput import machine  # noqa: E402
from plain_sglang import plain_sweeps, sweep  # noqa: E402

from actors.sglang.engine import SGLangEngine  # noqa: E402
from actors.sglang.server import ServerSpec, SGLangServer  # noqa: E402
from actors.validate import check_capture  # noqa: E402
from pipeline.driver.plan import default_aux_layers  # noqa: E402
from pipeline.format.final_norm import read_final_norm  # noqa: E402
from pipeline.format.shards import ShardLayout  # noqa: E402
from pipeline.intake.model import num_hidden_layers, prepare_default_model  # noqa: E402


def engine_rates(spec: ServerSpec, samples, window: int, layout: ShardLayout, threads: int) -> dict[str, float]:
    """hook / engine / encode on one capture server, at the given window."""
    tokens = sum(map(len, samples))
    requests = [(f"s{i}", ids) for i, ids in enumerate(samples)]
    keys = ("model_dir", "aux_layers", "final_layer", "cpu", "cpu_threads", "extra_flags")
    spec_kwargs = {k: getattr(spec, k) for k in keys}
    out = {}
    with SGLangEngine(spec_kwargs, max_in_flight=window, request_timeout_s=600, dump_timeout_s=30) as engine:
        out["hook"] = sweep(engine.server.url, samples, [window], engine._dump_dir)[window]
        engine.capture(requests[:4])
        for step in ("engine", "encode"):
            pool = ThreadPoolExecutor(threads)
            t0 = time.perf_counter()
            futures = [engine.submit(k, ids) for k, ids in requests]
            encoding = []
            for f in as_completed(futures):
                res = f.result()
                ids = dict(requests)[res.key]
                reason = res.error or check_capture(
                    res.capture, ids, layout.aux_width, layout.hidden_size, layout.final_layer
                )
                assert reason is None, reason
                if step == "encode":
                    cap = res.capture

                    def enc(cap=cap):
                        try:  # as the extractor encodes: straight from the dump file
                            return cap.encode(layout.codec)
                        finally:
                            cap.release()

                    encoding.append(pool.submit(enc))
                else:
                    res.capture.release()
            for f in encoding:
                f.result()
            out[step] = round(tokens / (time.perf_counter() - t0), 1)
            pool.shutdown()
    return out


def job_rate(samples, work: Path, server_flags: tuple[str, ...]) -> dict:
    inp = work / "short.jsonl"
    inp.write_text("".join(json.dumps({"id": f"s{i:04d}", "input_ids": ids}) + "\n" for i, ids in enumerate(samples)))
    out = work / "out"
    cmd = [sys.executable, "-m", "pipeline.cli", "run", "conf/default.yaml", "--set", f"input.path={inp}",
           "--set", f"output.path={out}"]  # fmt: skip
    if server_flags:
        cmd += ["--set", f"engine.server_flags=[{', '.join(server_flags)}]"]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env=dict(os.environ, RAY_ADDRESS=""))
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        print(proc.stderr[-3000:])
        return {"error": f"exit {proc.returncode}"}
    last = json.loads((out / "manifest.json").read_text())["last_run"]
    return {
        "tokens": last["tokens"],
        "after_engine_start": last["tokens_per_second_after_engine_start"],
        "steady": last["steady_tokens_per_second"],
        "end_to_end": round(last["tokens"] / last["extract_seconds"], 1),
        "wall_s": round(wall, 1),
        "first_result_s": last["first_result_seconds"],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--prompts", type=int, default=160)
    ap.add_argument("--windows", default="4,8,16")
    ap.add_argument("--plain-flags", default="--mem-fraction-static 0.2", help="what a user adds to the plain server")
    ap.add_argument("--plain-default-prompts", type=int, default=24, help="0: skip the memory-default probe")
    ap.add_argument(
        "--dtype",
        default=None,
        help="the servers' compute dtype (--dtype), every step alike; float32 where the CPU has no bf16 matmul",
    )
    ap.add_argument("--skip-job", action="store_true")
    ap.add_argument("--skip-project", action="store_true")
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "request_path_cpu.json")
    args = ap.parse_args()
    os.chdir(ROOT)
    model = prepare_default_model()
    dtype_flags = ("--dtype", args.dtype) if args.dtype else ()
    samples = prompts(model, args.prompts)
    lengths = sorted(map(len, samples))
    mean = sum(lengths) / len(lengths)
    windows = [int(w) for w in args.windows.split(",")]
    aux = tuple(default_aux_layers(num_hidden_layers(model)))
    threads = os.cpu_count() or 1
    layout = ShardLayout(aux, 576, final_norm=read_final_norm(model))
    result = {
        "benchmark": "per-request path, plain SGLang server to the job, short prompts, CPU",
        "machine": machine(),
        "date": datetime.date.today().isoformat(),
        "server_dtype": args.dtype or "the model's (bf16)",
        "command": "python bench/probes/profile_request_path_cpu.py " + " ".join(sys.argv[1:]),
        "prompts": {
            "count": len(samples),
            "tokens": sum(lengths),
            "median": lengths[len(lengths) // 2],
            "mean": round(mean, 1),
        },  # fmt: skip
        "tok_s": {},
    }
    with tempfile.TemporaryDirectory(dir="/dev/shm" if os.path.isdir("/dev/shm") else None) as d:
        spec = ServerSpec(
            model_dir=model, aux_layers=aux, dump_dir=Path(d), final_layer="pre_norm", extra_flags=dtype_flags
        )
        if args.plain_default_prompts:
            # SGLang's own memory default reserves most of the machine for KV (14.5 GB of 24 here); measured
            # on a few prompts only, to show what a user who passes no memory flag gets.
            probe = samples[: args.plain_default_prompts]
            rate = plain_sweeps(spec, probe, [8], dtype_flags)[0][8]
            result["plain_sglang_memory_default"] = {"prompts": len(probe), "window": 8, "tok_s": rate}
            print("plain, SGLang's memory default", rate, flush=True)
        plain = plain_sweeps(spec, samples, windows, tuple(args.plain_flags.split()) + dtype_flags)[0]
        print("plain", plain, flush=True)
        result["tok_s"]["plain"] = plain
        result["plain_flags"] = args.plain_flags
        best_w = max(plain, key=plain.get)
        base = plain[best_w]
        if not args.skip_project:
            import dataclasses

            with SGLangServer(dataclasses.replace(spec, capture=False)) as server:
                result["tok_s"]["project"] = sweep(server.url, samples, windows)
            print("project", result["tok_s"]["project"], flush=True)
    with tempfile.TemporaryDirectory(dir="/dev/shm" if os.path.isdir("/dev/shm") else None) as d:
        spec = ServerSpec(
            model_dir=model, aux_layers=aux, dump_dir=Path(d), final_layer="pre_norm", extra_flags=dtype_flags
        )
        steps = engine_rates(spec, samples, 8, layout, threads)
    print("capture steps at 8", steps, flush=True)
    result["tok_s"].update({k: {8: v} for k, v in steps.items()})
    if not args.skip_job:
        with tempfile.TemporaryDirectory() as work:
            job = job_rate(samples, Path(work), dtype_flags)
        print("job", job, flush=True)
        result["job"] = job
        if "after_engine_start" in job:
            # Not "steady" (first to last result): it counts the batches in flight at the first result as
            # work done after it, and read 652 tok/s where the rate after engine start was 524.
            result["tok_s"]["job"] = {8: job["after_engine_start"]}
    result["baseline"] = {"name": "plain", "window": best_w, "tok_s": base}
    result["ms_per_request_over_plain"] = {
        name: round((1 / max(r.values()) - 1 / base) * mean * 1000, 1) for name, r in result["tok_s"].items()
    }
    result["ratio_over_plain"] = {name: round(max(r.values()) / base, 3) for name, r in result["tok_s"].items()}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()

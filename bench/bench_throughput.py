"""Throughput of the job against the bare SGLang server, measured in one run on the same tokens.

  python bench/bench_throughput.py [--config conf/default.yaml] [--limit N]

1. bare:   the SGLang server with the job's truncation-safe flags but no aux capture and no hook,
           fed the tokenized dataset with the job's in-flight window (max_new_tokens=1).
2. hooked: the same server as the job starts it (aux capture + dump hook), same requests.
3. job:    `harvest run` on the same config into a fresh output directory.
Prints tok/s for each and the ratios hooked/bare and job/bare.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from actors.sglang_server import SGLangServer, ServerSpec  # noqa: E402
from conf import load_config  # noqa: E402
from pipeline.job import default_aux_layers  # noqa: E402
from pipeline.model import num_hidden_layers, resolve_model  # noqa: E402
from pipeline.tokenize import Tokenize  # noqa: E402

async def _send_all(url: str, samples: list[list[int]], window: int) -> float:
    sem = asyncio.Semaphore(window)

    async def one(session, i, ids):
        async with sem:
            payload = {"input_ids": ids, "rid": f"bench-{i}", "sampling_params": {"max_new_tokens": 1, "temperature": 0.0}}
            async with session.post(f"{url}/generate", json=payload) as r:
                await r.read()
                assert r.status == 200, r.status

    t0 = time.perf_counter()
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=3600)) as s:
        await asyncio.gather(*(one(s, i, ids) for i, ids in enumerate(samples)))
    return time.perf_counter() - t0


def measure(spec: ServerSpec, samples, window: int) -> float:
    with SGLangServer(spec) as server:
        asyncio.run(_send_all(server.url, samples[:4], window))  # warm-up
        return asyncio.run(_send_all(server.url, samples, window))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default="conf/default.yaml")
    ap.add_argument("--limit", type=int, default=0, help="first N input rows only (0: all)")
    args = ap.parse_args()
    cfg = load_config(args.config)
    model_dir = resolve_model(cfg.model.path)
    lines = Path(cfg.input.path).read_text().splitlines()
    if args.limit:
        lines = lines[: args.limit]
    tok = Tokenize(str(model_dir), cfg.extract.max_tokens, cfg.extract.overlength)
    rows = [tok.tokenize_line(f"x:{i}", line) for i, line in enumerate(lines) if line.strip()]
    samples = [r["input_ids"] for r in rows if r["status"] == "ok"]
    tokens = sum(map(len, samples))
    aux = cfg.extract.aux_layers or default_aux_layers(num_hidden_layers(model_dir))
    threads = cfg.engine.cpu_threads or os.cpu_count()
    results = {"samples": len(samples), "tokens": tokens, "window": cfg.engine.max_in_flight}
    with tempfile.TemporaryDirectory(dir="/dev/shm" if os.path.isdir("/dev/shm") else None) as d:
        spec = ServerSpec(model_dir=model_dir, aux_layers=tuple(aux), dump_dir=Path(d), cpu_threads=threads)
        results["bare_s"] = measure(dataclasses.replace(spec, capture=False), samples, cfg.engine.max_in_flight)
        print(f"bare: {tokens / results['bare_s']:,.0f} tok/s", flush=True)
        results["hooked_s"] = measure(spec, samples, cfg.engine.max_in_flight)
        print(f"hooked (no reads): {tokens / results['hooked_s']:,.0f} tok/s", flush=True)

    with tempfile.TemporaryDirectory() as out:
        input_path = cfg.input.path
        if args.limit:
            input_path = str(Path(out) / "input.jsonl")
            Path(input_path).write_text("\n".join(lines) + "\n")
        cmd = [sys.executable, "-m", "pipeline.cli", "run", args.config, "--set", f"output.path={out}/o",
               "--set", f"input.path={input_path}"]  # fmt: skip
        t0 = time.perf_counter()
        proc = subprocess.run(cmd, capture_output=True, text=True)
        results["job_wall_s"] = time.perf_counter() - t0
        if proc.returncode != 0:
            sys.exit(f"job failed:\n{proc.stderr[-3000:]}")
        manifest = json.loads((Path(out) / "o" / "manifest.json").read_text())
        last = manifest["last_run"]
        results["job_extract_s"] = last["extract_seconds"]
        results["job_tokens"] = last["tokens"]
        results["job_first_result_s"] = last["first_result_seconds"]
        results["job_steady_tok_s"] = last["steady_tokens_per_second"]
    bare = tokens / results["bare_s"]
    hooked = tokens / results["hooked_s"]
    job = results["job_tokens"] / results["job_extract_s"]
    steady = results["job_steady_tok_s"]
    results.update(bare_tok_s=bare, hooked_tok_s=hooked, job_tok_s=job, hooked_over_bare=hooked / bare,
                   job_over_bare=job / bare, job_steady_over_bare=steady / bare)  # fmt: skip
    print(json.dumps(results, indent=2))
    print(
        f"bare {bare:,.0f} tok/s | hooked {hooked:,.0f} tok/s ({hooked / bare:.2f}x) | "
        f"job {job:,.0f} tok/s incl. engine start-up ({job / bare:.2f}x bare) | "
        f"job steady state {steady:,.0f} tok/s ({steady / bare:.2f}x bare)"
    )


if __name__ == "__main__":
    main()

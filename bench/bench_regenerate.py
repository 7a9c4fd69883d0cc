"""Decode throughput of `harvest regenerate` against a plain `sglang.launch_server` generating the same prompts.

The baseline is a stock server as a user starts it on the CPU (bench/plain_sglang.py's CPU-mode flags, without
--disable-radix-cache: a user generating keeps SGLang's prefix cache, and so does the job's generation-only
server), given the same prompts (each conversation's last-turn prompt, rendered with the model's template) with
the same sampling (greedy, the same max_new_tokens), swept over the number of requests in flight for its best.
Then the job regenerates the same conversations with `generate.max_in_flight` at that best, and its rate is the
tokens generated from the moment every engine was up to the last result (the manifest's
tokens_per_second_after_engine_start). Both passes run back to back on one machine; the load average before
each is recorded.

    python bench/bench_regenerate.py [--prompts 48] [--max-new-tokens 32] [--windows 16,32,48]
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

import aiohttp
import requests

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests"))

import actors.sglang.server as server_mod  # noqa: E402
from actors.sglang.server import ServerSpec, SGLangServer, cpu_dtype_flags  # noqa: E402
from bench.plain_sglang import plain_env  # noqa: E402
from tests_support import sample_chats  # noqa: E402


def plain_generation_command(spec: ServerSpec, port: int) -> list[str]:
    cmd = [sys.executable, "-m", "sglang.launch_server", "--model-path", str(spec.model_dir), "--host", "127.0.0.1"]
    return cmd + ["--port", str(port), "--device", "cpu", "--attention-backend", "torch_native",
                  "--disable-cuda-graph", *spec.extra_flags]  # fmt: skip


def conversations(n: int) -> list[dict]:
    """n conversations from the shipped sample (cycled with fresh ids past its size), chats with one assistant turn
    or more and no tool calls."""
    chats = sample_chats()
    return [dict(chats[i % len(chats)], id=f"bench-{i}") for i in range(n)]


async def _send_all(url: str, prompts: list[list[int]], window: int, max_new: int) -> tuple[float, int]:
    sem = asyncio.Semaphore(window)
    tokens = 0

    async def one(session, i, ids):
        nonlocal tokens
        payload = {"input_ids": ids, "sampling_params": {"max_new_tokens": max_new, "temperature": 0.0}}
        async with sem, session.post(f"{url}/generate", json=payload) as r:
            body = await r.json()
            assert r.status == 200, body
        tokens += body["meta_info"]["completion_tokens"]

    t0 = time.perf_counter()
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=7200)) as s:
        await asyncio.gather(*(one(s, i, ids) for i, ids in enumerate(prompts)))
    return time.perf_counter() - t0, tokens


def plain_sweep(spec: ServerSpec, prompts, windows, max_new: int) -> dict:
    build, env = server_mod.build_command, server_mod.build_env
    server_mod.build_command, server_mod.build_env = plain_generation_command, plain_env
    out = {}
    try:
        with SGLangServer(spec) as server:
            asyncio.run(_send_all(server.url, prompts[:4], 4, 8))  # warm-up
            for w in windows:
                # Every window starts from an empty prefix cache, as the job's fresh server does.
                requests.post(f"{server.url}/flush_cache", timeout=60)
                load = os.getloadavg()[0]
                seconds, tokens = asyncio.run(_send_all(server.url, prompts, w, max_new))
                out[w] = {"tok_s": round(tokens / seconds, 1), "tokens": tokens, "seconds": round(seconds, 2),
                          "load_before": round(load, 2)}  # fmt: skip
                print(f"plain window {w}: {out[w]}", flush=True)
    finally:
        server_mod.build_command, server_mod.build_env = build, env
    return out


def job_pass(src: Path, out: Path, window: int, max_new: int, dtype: str) -> dict:
    import ray

    from conf import load_config
    from pipeline.driver.regenerate import regenerate

    cfg = load_config(
        REPO / "conf" / "regenerate.yaml",
        [f"input.path={src}", f"generate.output={out}", f"generate.max_new_tokens={max_new}",
         f"generate.max_in_flight={window}", "generate.on_truncated=keep", "progress.interval_s=30",
         f"engine.cpu_dtype={'float32' if dtype == 'float32' else 'auto'}"],
    )  # fmt: skip
    ray.init(num_cpus=2, object_store_memory=300 * 2**20, include_dashboard=False, log_to_driver=False)
    try:
        load = os.getloadavg()[0]
        t0 = time.perf_counter()
        summary = regenerate(cfg)
        wall = time.perf_counter() - t0
    finally:
        ray.shutdown()
    r = summary.this_run
    return {"window": window, "tok_s_after_engine_start": r["tokens_per_second_after_engine_start"],
            "tokens": r["generated_tokens"], "wall_s": round(wall, 1), "rows_ok": r["rows_ok"],
            "load_before": round(load, 2)}  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompts", type=int, default=48)
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--windows", default="16,32,48")
    ap.add_argument(
        "--dtype",
        choices=("auto", "float32"),
        default="auto",
        help="what both servers compute in (auto: the job's engine.cpu_dtype default, and the same for the plain one)",
    )
    ap.add_argument("--job-window", type=int, default=None, help="the job's window (default: the plain server's best)")
    ap.add_argument("--out", default=str(REPO / "bench" / "results" / "regenerate_cpu.json"))
    args = ap.parse_args()
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")

    from pipeline.intake.conversation import RegenerationCodec
    from pipeline.intake.model import prepare_default_model

    model_dir = prepare_default_model()
    convs = conversations(args.prompts)
    codec = RegenerationCodec(str(model_dir), {}, "id", "last", False)
    prompts = []
    for c in convs:
        conv = codec.parse(json.dumps(c))
        prompts.append(codec.prompt_ids(conv, conv.targets[0]))
    tmp = Path(tempfile.mkdtemp(prefix="bench-regen-"))
    src = tmp / "in.jsonl"
    src.write_text("".join(json.dumps(c) + "\n" for c in convs))

    # The same dtype the job's server computes in on this CPU (float32 where bf16 matmul is not native): a user
    # on this machine passes it too, as the job's README says.
    user_flags = ("--mem-fraction-static", "0.2", *cpu_dtype_flags(args.dtype, ()))
    spec = ServerSpec(
        model_dir=model_dir, aux_layers=(), dump_dir=tmp, capture=False, prefix_cache=True, extra_flags=user_flags
    )
    windows = [int(w) for w in args.windows.split(",")]
    plain = plain_sweep(dataclasses.replace(spec), prompts, windows, args.max_new_tokens)
    best = max(plain, key=lambda w: plain[w]["tok_s"])
    job = job_pass(src, tmp / "out", args.job_window or best, args.max_new_tokens, args.dtype)
    print(f"job: {job}", flush=True)
    result = {
        "what": "decode throughput: harvest regenerate (policy last, greedy) against a plain sglang.launch_server "
        "generating the same prompts, at the plain server's best window",
        "command": "python bench/bench_regenerate.py " + " ".join(sys.argv[1:]),
        "date": time.strftime("%Y-%m-%d", time.gmtime()),
        "machine": f"{os.cpu_count()} cores, {platform.machine()}, {platform.processor() or 'cpu'}",
        "model": "SmolLM2-135M-Instruct (the default model)",
        "prompts": len(prompts),
        "prompt_tokens": sum(map(len, prompts)),
        "max_new_tokens": args.max_new_tokens,
        "plain_server_flags": [
            "MODEL_DIR" if f == str(model_dir) else f for f in plain_generation_command(spec, 0)[3:]
        ],
        "plain_by_window": plain,
        "plain_best_window": best,
        "plain_best_tok_s": plain[best]["tok_s"],
        "job": job,
        "ratio": round(job["tok_s_after_engine_start"] / plain[best]["tok_s"], 3),
    }
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps({k: result[k] for k in ("plain_best_window", "plain_best_tok_s", "ratio")}))


if __name__ == "__main__":
    main()

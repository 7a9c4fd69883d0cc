"""A plain `sglang.launch_server` as a user starts it on the CPU: the benchmarks' baseline.

SGLang's defaults plus only what CPU mode needs (--device cpu --attention-backend torch_native
--disable-cuda-graph, SGLANG_USE_CPU_ENGINE=1 and the sgl_kernel stand-in on its PYTHONPATH) and
--disable-radix-cache (a capture needs every position computed); nothing of the project's: no hook, no
thread settings, no memory settings of ours. `flags` are what the user adds (e.g. --mem-fraction-static 0.2,
since SGLang's default reserves most of a small machine for its KV cache; --dtype float32 on a CPU without
bf16 matmul).
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import sys
import time

import aiohttp

import actors.sglang.server as server_mod
from actors.sglang.server import ServerSpec, SGLangServer
from patches.sglang import server_pythonpath


def plain_command(spec: ServerSpec, port: int) -> list[str]:
    cmd = [sys.executable, "-m", "sglang.launch_server", "--model-path", str(spec.model_dir), "--host", "127.0.0.1"]
    return cmd + ["--port", str(port), "--device", "cpu", "--attention-backend", "torch_native",
                  "--disable-cuda-graph", "--disable-radix-cache", *spec.extra_flags]  # fmt: skip


def plain_env(spec: ServerSpec) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HIDDEN_HARVEST", "OMP_", "MKL_"))}
    env["PYTHONPATH"] = os.pathsep.join(str(p) for p in server_pythonpath(cpu=True)[1:])  # the stand-in only
    env["SGLANG_USE_CPU_ENGINE"] = "1"
    return env


async def send_all(url: str, samples: list[list[int]], window: int, rid_prefix: str = "bench") -> float:
    """Seconds for every prompt through /generate (max_new_tokens 1) under a window of `window` requests."""
    sem = asyncio.Semaphore(window)

    async def one(session, i, ids):
        async with sem:
            payload = {
                "input_ids": ids,
                "rid": f"{rid_prefix}-{i}-{time.monotonic_ns()}",
                "sampling_params": {"max_new_tokens": 1, "temperature": 0.0},
            }
            async with session.post(f"{url}/generate", json=payload) as r:
                await r.read()
                assert r.status == 200, r.status

    t0 = time.perf_counter()
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=3600)) as s:
        await asyncio.gather(*(one(s, i, ids) for i, ids in enumerate(samples)))
    return time.perf_counter() - t0


def plain_sweeps(
    spec: ServerSpec, samples: list[list[int]], windows, flags: tuple[str, ...] = (), repeats: int = 1
) -> list[dict[int, float]]:
    """One plain server, a warm-up, then every window `repeats` times: [{window: tok/s}] per repeat."""
    tokens = sum(map(len, samples))
    build, env = server_mod.build_command, server_mod.build_env
    server_mod.build_command, server_mod.build_env = plain_command, plain_env
    try:
        with SGLangServer(dataclasses.replace(spec, capture=False, extra_flags=tuple(flags))) as server:
            asyncio.run(send_all(server.url, samples[:4], 4))
            sweeps = []
            for r in range(repeats):
                sweep = {}
                for w in windows:
                    sweep[w] = round(tokens / asyncio.run(send_all(server.url, samples, w)), 1)
                    print(f"  plain run {r + 1}/{repeats} window {w}: {sweep[w]:,.0f} tok/s", flush=True)
                sweeps.append(sweep)
            return sweeps
    finally:
        server_mod.build_command, server_mod.build_env = build, env

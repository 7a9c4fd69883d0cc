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
import contextlib
import dataclasses
import os
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import aiohttp

import actors.sglang.server as server_mod
from actors.sglang.server import ServerSpec, SGLangServer
from patches.sglang import server_pythonpath

# What a user adds to a plain server on a small machine: SGLang's default reserves most of its memory for the
# KV cache. The plain baseline's flags wherever a benchmark does not take them from its command line.
USER_FLAGS = ("--mem-fraction-static", "0.2")


def plain_command(spec: ServerSpec, port: int) -> list[str]:
    cmd = [sys.executable, "-m", "sglang.launch_server", "--model-path", str(spec.model_dir), "--host", "127.0.0.1"]
    return cmd + ["--port", str(port), "--device", "cpu", "--attention-backend", "torch_native",
                  "--disable-cuda-graph", "--disable-radix-cache", *spec.extra_flags]  # fmt: skip


def plain_env(spec: ServerSpec) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HIDDEN_HARVEST", "OMP_", "MKL_"))}
    env["PYTHONPATH"] = os.pathsep.join(str(p) for p in server_pythonpath(cpu=True)[1:])  # the stand-in only
    env["SGLANG_USE_CPU_ENGINE"] = "1"
    return env


async def send_all(url: str, samples: list[list[int]], window: int, dump_dir: Path | None = None) -> float:
    """Seconds for every prompt through /generate (max_new_tokens 1) under a window of `window` requests. The
    rid carries the capture hook's prefix and the prompt length, so a capture server dumps it too; with
    `dump_dir`, each dump is awaited and deleted unread (the hook's cost without the client's)."""
    sem = asyncio.Semaphore(window)

    async def one(session, i, ids):
        rid = f"{server_mod.RID_PREFIX}bench{i}-{time.monotonic_ns()}.t{len(ids)}"
        async with sem:
            payload = {"input_ids": ids, "rid": rid, "sampling_params": {"max_new_tokens": 1, "temperature": 0.0}}
            async with session.post(f"{url}/generate", json=payload) as r:
                await r.read()
                assert r.status == 200, r.status
        if dump_dir is not None:
            path = dump_dir / f"{rid}.hhd"
            while not path.exists():
                await asyncio.sleep(0.002)
            path.unlink()

    t0 = time.perf_counter()
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=3600)) as s:
        await asyncio.gather(*(one(s, i, ids) for i, ids in enumerate(samples)))
    return time.perf_counter() - t0


def sweep(url: str, samples: list[list[int]], windows, dump_dir: Path | None = None, label: str = "") -> dict:
    """{window: tok/s} over every prompt at each window, after a warm-up of four."""
    tokens = sum(map(len, samples))
    asyncio.run(send_all(url, samples[:4], 4, dump_dir))
    out = {}
    for w in windows:
        out[w] = round(tokens / asyncio.run(send_all(url, samples, w, dump_dir)), 1)
        if label:
            print(f"  {label} window {w}: {out[w]:,.0f} tok/s", flush=True)
    return out


@contextlib.contextmanager
def plain_server(spec: ServerSpec, flags: tuple[str, ...] = ()) -> Iterator[SGLangServer]:
    """A plain server (started, then closed) with the spec's model and threads and the user's `flags`."""
    build, env = server_mod.build_command, server_mod.build_env
    server_mod.build_command, server_mod.build_env = plain_command, plain_env
    try:
        with SGLangServer(dataclasses.replace(spec, capture=False, extra_flags=tuple(flags))) as server:
            yield server
    finally:
        server_mod.build_command, server_mod.build_env = build, env


def plain_sweeps(
    spec: ServerSpec, samples: list[list[int]], windows, flags: tuple[str, ...] = (), repeats: int = 1
) -> list[dict[int, float]]:
    """One plain server, every window `repeats` times: [{window: tok/s}] per repeat."""
    with plain_server(spec, flags) as server:
        return [sweep(server.url, samples, windows, label=f"plain run {r + 1}/{repeats}") for r in range(repeats)]

"""The SGLang engine replica an actor owns: a server subprocess plus a continuous request stream.

`submit(ids)` may be called from any thread at any time: requests from every batch the actor holds share
one bounded in-flight window, so the server never drains at a batch boundary. Each request goes out with
its own request id; its result is exactly the dump the hook published for that id (opened, then
unlinked; the body is read by the encoder). Results are matched by id, never by position or arrival order. Per-request problems come back
as reasons; a server that has died raises EngineDied from `ensure_alive` so the caller can retry (or fail
the actor).
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import random
import shutil
import threading
import time
import uuid
from concurrent.futures import Future, as_completed
from pathlib import Path

import aiohttp

from actors.dump import DumpError, dump_path, read_dump
from actors.engine import EngineDied, GenerateResult, RequestResult
from actors.sglang.dump_dir import default_dump_root, make_dump_dir, remove_orphaned_dump_dirs
from actors.sglang.server import (
    RID_PREFIX,
    ServerSpec,
    SGLangServer,
    build_command,
    cpu_dtype_flags,
    cpu_kv_tokens,
)
from actors.sglang.window import WindowClock

logger = logging.getLogger(__name__)


class SGLangEngine:
    name = "sglang"
    # A server start that stalls or exits is tried once more (fresh ports, a fresh process) before the actor
    # fails: under concurrent starts one can stall with nothing in the server log to act on, and Ray's wait
    # for actors would then fail the whole run.
    start_attempts = 2

    @classmethod
    def kwargs_for(
        cls,
        cfg,
        model_dir: str,
        aux_layers: tuple[int, ...],
        cuda: bool,
        cpu_threads: int,
        final_layer: str = "post_norm",
        capture_layout: str = "planes",
        capture: bool = True,
        generate_in_flight: int | None = None,
        max_prompt_tokens: int | None = None,
        debug: dict | None = None,
    ) -> dict:
        """Constructor arguments from the engine's config section (conf.schema.SGLangEngineConfig).
        `capture_layout`: the dump body the output encodes from (actors/dump.py): bf16 planes, or fp8.
        `capture=False`: a server without the hook or aux capture, for generation only (regeneration), with
        `generate_in_flight` generations in flight.
        `max_prompt_tokens`: the longest prompt the job sends (extract.max_tokens); a capturing CPU server's
        KV pool is sized to it (server.cpu_kv_tokens). A generation server decodes, so it keeps the default.
        `debug`: the debug section's values (conf.schema.DebugConfig); none of them applies to this engine."""
        kv_tokens = None
        if capture and not cuda and max_prompt_tokens:
            kv_tokens = cpu_kv_tokens(cfg.max_in_flight, max_prompt_tokens)
        return {
            "spec_without_dump": {
                "model_dir": model_dir,
                "aux_layers": tuple(aux_layers),
                "final_layer": final_layer,
                "capture_layout": capture_layout,
                "tp_size": cfg.tp_size,
                "chunked_prefill_size": cfg.chunked_prefill_size,
                "cpu": not cuda,
                "cpu_threads": cpu_threads,
                # Decided here, on the driver, so the manifest's flags are the ones every server runs with.
                "extra_flags": tuple(cfg.server_flags)
                + (() if cuda else cpu_dtype_flags(cfg.cpu_dtype, tuple(cfg.server_flags))),
                "startup_timeout_s": cfg.startup_timeout_s,
                "capture": capture,
                "prefix_cache": not capture,  # generation only: turn k+1 reuses turn k's prefix
                "kv_tokens": kv_tokens,
            },
            "max_in_flight": cfg.max_in_flight,
            "generate_in_flight": generate_in_flight or cfg.max_in_flight,
            "request_timeout_s": cfg.request_timeout_s,
            "dump_timeout_s": cfg.dump_timeout_s,
        }

    @classmethod
    def generation_kwargs(cls, cfg, model_dir: str, cuda: bool, cpu_threads: int, in_flight: int) -> dict:
        """Constructor arguments for regeneration: the same server and flags, without the hook or aux capture
        (nothing is captured; a decode step then costs what it costs a plain server)."""
        return cls.kwargs_for(cfg, model_dir, (), cuda, cpu_threads, capture=False, generate_in_flight=in_flight)

    @classmethod
    def provenance(cls, kwargs: dict, cuda: bool) -> dict:
        """What the manifest records of this engine: the server's exact command-line flags."""
        from importlib.metadata import version

        spec = ServerSpec(dump_dir=Path("DUMP_DIR"), **kwargs["spec_without_dump"])
        flags = build_command(spec, port=0)[3:]  # without the interpreter and `-m sglang.launch_server`
        return {"name": cls.name, "version": version("sglang"), "device": "cuda" if cuda else "cpu", "flags": flags}

    def __init__(
        self,
        spec_without_dump: dict,
        max_in_flight: int,
        request_timeout_s: float,
        dump_timeout_s: float = 30.0,
        generate_in_flight: int | None = None,
    ):
        remove_orphaned_dump_dirs(default_dump_root())
        self._dump_dir = make_dump_dir(default_dump_root())
        self.spec = ServerSpec(dump_dir=self._dump_dir, **spec_without_dump)
        self.max_in_flight = max_in_flight
        # Generation has a window of its own: a decode step batches every running request, so it wants
        # many more in flight than a prefill-only capture does.
        self.generate_in_flight = generate_in_flight or max_in_flight
        self.request_timeout_s = request_timeout_s
        # The hook publishes a dump from its writer thread, so it may land just after the HTTP answer.
        self.dump_timeout_s = dump_timeout_s
        self.server = SGLangServer(self.spec)
        self._tag = uuid.uuid4().hex[:12]
        self._counter = 0
        self._lock = threading.Lock()  # rid counter and server restarts, from any caller thread
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._window = WindowClock(max_in_flight)

    def start(self) -> SGLangEngine:
        for attempt in range(1, self.start_attempts + 1):
            try:
                self.server.start()
                break
            except EngineDied as e:
                if attempt == self.start_attempts:
                    raise
                logger.warning(
                    "SGLang server start %d of %d failed, starting it again: %s", attempt, self.start_attempts, e
                )
                self.server.close()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="sglang-engine-requests", daemon=True)
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self._open_session(), self._loop).result()
        self._warm_up()
        # The window's clock starts when the job's requests may: warm-up is start-up.
        self._loop.call_soon_threadsafe(self._window.reset)
        return self

    def _warm_up(self) -> None:
        """One window of synthetic prompts (lengths log-uniform in 32..512, fixed) through the server before
        the engine counts as started. SGLang's own warm-up is one token; with this one, a fresh engine's first
        requests run as fast as its later ones (bench/results/server_warmth_cpu.json). Their request ids lack
        the capture prefix, so the hook publishes nothing for them (and a test's fault injection never sees
        them). Ids below 1,000 exist in every vocabulary. A failure here is logged, not raised: the job's own
        requests say whether the server works."""
        rng = random.Random(0)
        lengths = [int(32 * 16 ** rng.random()) for _ in range(self.max_in_flight)]
        t0 = time.monotonic()

        async def all_of() -> list:
            return await asyncio.gather(
                *(
                    self._generate([100 + (i * 7 + j) % 900 for j in range(n)], f"warm-up-{self._tag}-{i}")
                    for i, n in enumerate(lengths)
                )
            )

        errors = [e for e, _ in asyncio.run_coroutine_threadsafe(all_of(), self._loop).result() if e]
        took = time.monotonic() - t0
        if errors:
            logger.warning(
                "SGLang engine warm-up: %d of %d requests failed, e.g. %s", len(errors), len(lengths), errors[0]
            )
        self.server.phases["warm_up_s"] = round(self.server.phases.get("warm_up_s", 0.0) + took, 3)
        logger.info("SGLang engine warmed up with %d prompts (%d tokens) in %.1fs", len(lengths), sum(lengths), took)

    async def _open_session(self) -> None:
        self._sem = asyncio.Semaphore(self.max_in_flight)
        self._gen_sem = asyncio.Semaphore(self.generate_in_flight)
        self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=self.request_timeout_s))

    def restart(self) -> None:
        logger.warning("restarting SGLang server; last log lines:\n%s", self.server.log_tail(20))
        self.server.close()
        self.server.start()

    def ensure_alive(self) -> None:
        """Restart a dead server (once, whichever thread sees it first); raises EngineDied if it stays down."""
        with self._lock:
            if not self.server.alive():
                self.restart()

    def close(self) -> None:
        if self._loop is not None and self._loop.is_running():
            asyncio.run_coroutine_threadsafe(self._session.close(), self._loop).result(timeout=10)
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=10)
        self._loop = None
        self.server.close()
        shutil.rmtree(self._dump_dir, ignore_errors=True)

    def __enter__(self) -> SGLangEngine:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()

    def stats(self) -> dict:
        """Where the server's start went (the server keeps its own request counters, on its metrics endpoint)."""
        out = {"start": dict(self.server.phases)} if self.server.phases else {}
        if self._window.requests:
            out["window"] = self._window.snapshot()
        return out

    def healthy(self) -> bool:
        return self.server.alive()

    def _next_rid(self, tokens: int) -> str:
        # Unique per attempt: a retry never reads a dump left by an earlier attempt. The prompt length
        # rides along (`.t<tokens>`) so the hook knows which prefill chunk is a request's last.
        with self._lock:
            self._counter += 1
            return f"{RID_PREFIX}{self._tag}-{self._counter}.t{tokens}"

    def submit(self, key: str, ids: list[int], order: float = 0.0) -> Future:
        """Queue one request; the Future gives its RequestResult. Thread-safe. (`order` is the hf engine's
        batching hint; the server schedules its own requests.)"""
        if self._loop is None:
            raise EngineDied("engine is not started")
        return asyncio.run_coroutine_threadsafe(self._capture_one(key, ids, self._next_rid(len(ids))), self._loop)

    def submit_generate(self, key: str, ids: list[int], sampling: dict) -> Future:
        """Queue one generation (actors.engine.Generator); the Future gives its GenerateResult. Thread-safe.
        Its request id lacks the capture prefix, so a capturing server's hook publishes nothing for it."""
        if self._loop is None:
            raise EngineDied("engine is not started")
        with self._lock:
            self._counter += 1
            rid = f"gen-{self._tag}-{self._counter}"
        return asyncio.run_coroutine_threadsafe(self._generate_one(key, ids, rid, sampling), self._loop)

    async def _generate_one(self, key: str, ids: list[int], rid: str, sampling: dict) -> GenerateResult:
        params = {
            "max_new_tokens": sampling["max_new_tokens"],
            "temperature": sampling["temperature"],
            "top_p": sampling["top_p"],
        }
        if sampling.get("seed") is not None:
            # SGLang samples by it only with --enable-deterministic-inference (engine.server_flags).
            params["sampling_seed"] = int(sampling["seed"])
        payload = {"input_ids": ids, "rid": rid, "sampling_params": params}
        body, error, latency = await self._post(payload, self._gen_sem)
        if error is not None:
            return GenerateResult(key, [], "", "", error, 0.0)
        try:
            out = json.loads(body)
            finish = (out["meta_info"].get("finish_reason") or {}).get("type", "")
            return GenerateResult(key, list(out.get("output_ids") or []), out["text"], finish, None, latency)
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            return GenerateResult(key, [], "", "", f"unreadable answer: {type(e).__name__}: {e}", latency)

    def capture(self, requests: list[tuple[str, list[int]]]) -> dict[str, RequestResult]:
        """Every request at once under the window; results keyed by the caller's key."""
        futures = [self.submit(key, ids) for key, ids in requests]
        return {r.key: r for r in (f.result() for f in as_completed(futures))}

    async def _generate(self, ids: list[int], rid: str) -> tuple[str | None, float]:
        """One /generate of the prompt under the in-flight window: (None when answered, else why not; seconds
        from its turn in the window to the answer)."""
        payload = {
            "input_ids": ids,
            "rid": rid,
            # One new token: the prefill pass carries every prompt position; no decode pass follows.
            "sampling_params": {"max_new_tokens": 1, "temperature": 0.0},
        }
        _, error, latency = await self._post(payload, self._sem)
        return error, latency

    async def _post(self, payload: dict, window: asyncio.Semaphore) -> tuple[bytes | None, str | None, float]:
        """One /generate under `window` (a capture's or a generation's): (the answer's body, None, seconds from
        its turn in the window to the answer), or (None, why not, 0)."""
        async with window:
            t0 = time.monotonic()
            clock = self._window if window is self._sem else None
            if clock is not None:
                clock.change(+1, t0)
            try:
                async with self._session.post(f"{self.server.url}/generate", json=payload) as resp:
                    body = await resp.read()
                    if resp.status != 200:
                        return None, f"server answered {resp.status}: {body[:200]!r}", 0.0
            except (aiohttp.ClientError, asyncio.TimeoutError) as e:
                return None, f"request failed: {type(e).__name__}: {e}", 0.0
            finally:
                if clock is not None:
                    clock.change(-1, time.monotonic())
            return body, None, time.monotonic() - t0

    async def _capture_one(self, key: str, ids: list[int], rid: str) -> RequestResult:
        error, latency = await self._generate(ids, rid)
        if error is not None:
            return RequestResult(key, None, error, 0.0, rid)
        path = dump_path(self._dump_dir, rid)
        if not await self._published(path):
            return RequestResult(
                key, None, f"no hidden-state dump for request {rid} after {self.dump_timeout_s:g}s", latency, rid
            )
        try:
            cap = read_dump(path)
        except (DumpError, OSError) as e:
            return RequestResult(key, None, f"unreadable dump: {e}", latency, rid)
        finally:
            path.unlink(missing_ok=True)  # the open descriptor keeps the bytes until the sample is encoded
        if cap.header.rid != rid:
            cap.close()
            return RequestResult(key, None, f"dump for {rid} names request {cap.header.rid}", latency, rid)
        return RequestResult(key, cap, None, latency, rid)

    async def _published(self, path: Path) -> bool:
        deadline = time.monotonic() + self.dump_timeout_s
        delay = 0.001
        while not os.path.exists(path):
            if time.monotonic() > deadline:
                return False
            await asyncio.sleep(delay)
            delay = min(delay * 2, 0.05)
        return True

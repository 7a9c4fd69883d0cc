"""The SGLang engine replica an actor owns: a server subprocess plus a concurrent request client.

`capture(requests)` sends every request at once under a bounded in-flight window, each with its own
request id, and reads back exactly the dump the hook wrote for that id. Results are realigned by
key, never by position or arrival order. Per-request problems come back as reasons; a server that
has died raises EngineDied so the caller can restart it (or fail the actor).
"""

from __future__ import annotations

import asyncio
import logging
import shutil
import tempfile
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import aiohttp

from actors.dump import Capture, DumpError, dump_path, read_dump
from actors.sglang_server import RID_PREFIX, EngineDied, SGLangServer, ServerSpec

logger = logging.getLogger(__name__)


@dataclass
class RequestResult:
    key: str
    capture: Capture | None
    error: str | None
    latency_s: float


def default_dump_root() -> Path:
    # /dev/shm keeps dumps in memory: they live for milliseconds between the hook and the reader.
    shm = Path("/dev/shm")
    return shm if shm.is_dir() else Path(tempfile.gettempdir())


class SGLangEngine:
    def __init__(self, spec_without_dump: dict, max_in_flight: int, request_timeout_s: float):
        self._dump_dir = Path(tempfile.mkdtemp(prefix="hidden-harvest-", dir=default_dump_root()))
        self.spec = ServerSpec(dump_dir=self._dump_dir, **spec_without_dump)
        self.max_in_flight = max_in_flight
        self.request_timeout_s = request_timeout_s
        self.server = SGLangServer(self.spec)
        self._tag = uuid.uuid4().hex[:12]
        self._counter = 0

    def start(self) -> SGLangEngine:
        self.server.start()
        return self

    def restart(self) -> None:
        logger.warning("restarting SGLang server; last log lines:\n%s", self.server.log_tail(20))
        self.server.close()
        self.server.start()

    def close(self) -> None:
        self.server.close()
        shutil.rmtree(self._dump_dir, ignore_errors=True)

    def __enter__(self) -> SGLangEngine:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()

    def healthy(self) -> bool:
        return self.server.healthy()

    def _next_rid(self) -> str:
        # Unique per attempt: a retry never reads a dump left by an earlier attempt.
        self._counter += 1
        return f"{RID_PREFIX}{self._tag}-{self._counter}"

    def capture(self, requests: list[tuple[str, list[int]]]) -> dict[str, RequestResult]:
        jobs = [(key, ids, self._next_rid()) for key, ids in requests]
        results = asyncio.run(self._capture_all(jobs))
        return {r.key: r for r in results}

    async def _capture_all(self, jobs) -> list[RequestResult]:
        sem = asyncio.Semaphore(self.max_in_flight)
        timeout = aiohttp.ClientTimeout(total=self.request_timeout_s)
        async with aiohttp.ClientSession(timeout=timeout) as session:
            return await asyncio.gather(*(self._capture_one(session, sem, *job) for job in jobs))

    async def _capture_one(self, session, sem, key: str, ids: list[int], rid: str) -> RequestResult:
        payload = {
            "input_ids": ids,
            "rid": rid,
            # One new token: the prefill pass carries every prompt position; no decode pass follows.
            "sampling_params": {"max_new_tokens": 1, "temperature": 0.0},
        }
        async with sem:
            t0 = time.monotonic()
            try:
                async with session.post(f"{self.server.url}/generate", json=payload) as resp:
                    body = await resp.read()
                    if resp.status != 200:
                        return RequestResult(key, None, f"server answered {resp.status}: {body[:200]!r}", 0.0)
            except (aiohttp.ClientError, asyncio.TimeoutError) as e:
                return RequestResult(key, None, f"request failed: {type(e).__name__}: {e}", 0.0)
            latency = time.monotonic() - t0
        path = dump_path(self._dump_dir, rid)
        try:
            cap = read_dump(path)
        except FileNotFoundError:
            return RequestResult(key, None, f"no hidden-state dump for request {rid}", latency)
        except (DumpError, ValueError) as e:
            return RequestResult(key, None, f"unreadable dump: {e}", latency)
        finally:
            path.unlink(missing_ok=True)
        if cap.header.get("rid") != rid:
            return RequestResult(key, None, f"dump for {rid} names request {cap.header.get('rid')}", latency)
        return RequestResult(key, cap, None, latency)

    def ensure_alive(self) -> None:
        """Restart a dead server; restart() raises EngineDied when the new one does not come up."""
        if not self.server.healthy():
            self.restart()

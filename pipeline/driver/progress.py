"""Driver-side counters and the one-line status, fed by the small metadata rows the actors return."""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass, field

from pipeline.format.storage import human_bytes

logger = logging.getLogger(__name__)


def human_duration(s: float) -> str:
    s = int(max(0, s))
    h, rem = divmod(s, 3600)
    m, sec = divmod(rem, 60)
    return f"{h}h{m:02d}m" if h else (f"{m}m{sec:02d}s" if m else f"{sec}s")


@dataclass
class Progress:
    total_samples: int  # rows this run will process (after resume and filtering)
    total_tokens: int
    interval_s: float = 10.0
    done: int = 0
    ok: int = 0
    errors: int = 0
    filtered: int = 0
    tokens: int = 0  # tokens of samples committed this run
    bytes: int = 0  # exact committed shard bytes this run
    processed_tokens: int = 0
    last_result_at: float = 0.0  # tokens of every row handled, whatever its status (drives the ETA)
    started: float = field(default_factory=time.monotonic)
    # When the first results arrived: the rate after it excludes engine start-up (steady state).
    first_result_at: float | None = None
    tokens_at_first: int = 0
    _last_log: float = 0.0
    # Per actor (host:pid): samples and tokens committed; the earliest engine start (wall clock).
    actors: dict = field(default_factory=dict)
    engines_ready_unix: float | None = None
    last_result_unix: float = 0.0

    def update_actors(self, actors, ready_unix, statuses, num_tokens, started_unix=None, engine_stats=None) -> None:
        """`started_unix`: when each row's batch reached its actor; per actor, the gap from its engine up to
        its first batch is kept (`first_batch_after_ready_s`): time a GPU sat ready with nothing to do.
        `engine_stats`: the engine's cumulative counters (JSON) as of each row's batch; the latest is kept."""
        parsed: dict[str, dict] = {}  # a batch's rows share one string
        for i, (actor, ready, status, n) in enumerate(zip(actors, ready_unix, statuses, num_tokens)):
            a = self.actors.setdefault(actor, {"samples": 0, "tokens": 0})
            if engine_stats is not None and engine_stats[i]:
                text = engine_stats[i]
                if text not in parsed:
                    parsed[text] = json.loads(text)
                stats = parsed[text]
                if _latest(stats) >= _latest(a.get("engine", {})):  # batches return out of order
                    a["engine"] = stats
            if status == "ok":
                a["samples"] += 1
                a["tokens"] += n
            if ready and (self.engines_ready_unix is None or ready < self.engines_ready_unix):
                self.engines_ready_unix = ready
            if started_unix is not None and ready and started_unix[i]:
                gap = round(max(0.0, started_unix[i] - ready), 3)
                a["first_batch_after_ready_s"] = min(gap, a.get("first_batch_after_ready_s", gap))
        self.last_result_unix = time.time()

    def tokens_per_second_after_engine_start(self) -> float | None:
        """Committed tok/s from the first engine ready to the last result: the job's rate without Ray and
        model start-up, every batch included (unlike the steady rate, which starts at the first result)."""
        if self.engines_ready_unix is None or self.last_result_unix <= self.engines_ready_unix:
            return None
        return self.tokens / (self.last_result_unix - self.engines_ready_unix)

    def update(self, statuses, num_tokens, nbytes) -> None:
        first = self.first_result_at is None
        for status, n, b in zip(statuses, num_tokens, nbytes):
            self.done += 1
            if status == "ok":
                self.ok += 1
                self.tokens += n
                self.bytes += b
            elif status == "filtered":
                self.filtered += 1
            else:
                self.errors += 1
        self.processed_tokens += sum(num_tokens)
        if first:
            self.first_result_at, self.tokens_at_first = time.monotonic(), self.tokens
        self.last_result_at = time.monotonic()

    def steady_tokens_per_second(self) -> float | None:
        """Committed tok/s between the first and the last result (None before two results)."""
        if self.first_result_at is None or self.last_result_at <= self.first_result_at:
            return None
        return (self.tokens - self.tokens_at_first) / (self.last_result_at - self.first_result_at)

    def elapsed(self) -> float:
        return time.monotonic() - self.started

    def line(self) -> str:
        elapsed = max(self.elapsed(), 1e-9)
        pct = 100.0 * self.done / self.total_samples if self.total_samples else 100.0
        sps = self.done / elapsed
        tps = self.tokens / elapsed
        left = self.total_tokens - self.processed_tokens
        eta = human_duration(left / tps) if tps > 0 and left > 0 else ("0s" if left <= 0 else "?")
        return (
            f"{self.done:,}/{self.total_samples:,} ({pct:.1f}%) | {sps:.2f} samples/s | {tps:,.0f} tok/s | "
            f"ETA {eta} | errors {self.errors} | {human_bytes(self.bytes)} written"
        )

    def maybe_log(self, force: bool = False) -> None:
        now = time.monotonic()
        if force or now - self._last_log >= self.interval_s:
            self._last_log = now
            logger.info("%s", self.line())


def startup(ray_s: float | None, read_s: float, extract_started_unix: float, actors: dict) -> dict:
    """Where a run's start-up went, in seconds: Ray's start (None when the process came with Ray running),
    reading and tokenizing the input, and for the actor whose engine was ready last: Ray placing it and
    starting its process (up to its first line of code), the engine's load (with its parts where the engine
    reports them) and its warm-up. From the
    engines' own `start` counters (actors/extractor.py)."""
    starts = [(a.get("engine") or {}).get("start") or {} for a in actors.values()]
    starts = [s for s in starts if s.get("ready_unix")]
    out: dict = {"ray_s": None if ray_s is None else round(ray_s, 3), "read_and_tokenize_s": round(read_s, 3)}
    if starts:
        last = max(starts, key=lambda s: s["ready_unix"])
        out |= {
            "actor_s": round(max(0.0, last["actor_init_unix"] - extract_started_unix), 3),
            "engine_load_s": last.get("load_s"),
            **({"engine_load_parts_s": last["load_parts_s"]} if last.get("load_parts_s") else {}),
            "warm_up_s": last.get("warm_up_s"),
            "engines_ready_after_s": round(last["ready_unix"] - extract_started_unix, 3),
        }
    return out


def startup_line(s: dict) -> str:
    parts = [
        f"Ray {s['ray_s']:.1f} s" if s.get("ray_s") is not None else "Ray already running",
        f"read and tokenize {s['read_and_tokenize_s']:.1f} s",
    ]
    if "actor_s" in s:
        parts += [f"actor {s['actor_s']:.1f} s"]
        if s.get("engine_load_s") is not None:
            within = ", ".join(f"{k} {v:.1f} s" for k, v in (s.get("engine_load_parts_s") or {}).items())
            parts += [f"engine load {s['engine_load_s']:.1f} s" + (f" ({within})" if within else "")]
        parts += [f"warm-up {s['warm_up_s']:.1f} s"] if s.get("warm_up_s") is not None else []
    return "start-up: " + ", ".join(parts) + " (the engine ready last)" * ("actor_s" in s)


def _latest(stats: dict) -> tuple:
    """How late an engine snapshot is: its forwards, then when its batch committed. Batches that finish after
    the last forward share the count, and the driver may get their rows in any order; the last committed
    one's snapshot holds the run's tail and the actor's whole shard I/O."""
    return stats.get("forwards", 0), stats.get("batch_committed_unix") or 0.0

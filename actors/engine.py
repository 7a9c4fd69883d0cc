"""The engine contract: what the extractor asks of an engine replica, the types every engine shares, and
the registry that maps `engine.name` to an engine.

An engine is one replica of the target model that turns token ids into captures (actors/dump.py's
Capture: the aux layers and the final state as bf16 planes, with the header validation reads). It has an
explicit lifecycle (start, close; never __del__), is asked for work through `submit` from any thread, and
raises EngineDied when it cannot serve any more, so that Ray restarts the actor; a failure of one request
is that request's RequestResult.error instead.

Adding an engine: one module under actors/ with a class that satisfies Engine, one config class in
conf/schema.py, one `register(...)` line at the end of this file.
"""

from __future__ import annotations

import importlib
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Protocol

from actors.dump import Capture


class EngineDied(RuntimeError):
    """The engine (its server process, or its worker thread) is gone or unhealthy; the actor must fail so
    Ray restarts it."""


@dataclass
class RequestResult:
    key: str  # the caller's key (the sample id): results come back out of order
    capture: Capture | None  # None when the request failed
    error: str | None  # why it failed, as an error row's reason
    latency_s: float
    rid: str = ""  # the request id the engine used (SGLang's rid; the hook names the dump by it)


@dataclass
class GenerateResult:
    """One generation: the new tokens and text, or why there are none."""

    key: str
    output_ids: list[int]
    text: str
    finish_reason: str  # stop | length | abort ("" when the request failed)
    error: str | None  # the request failed (engine or transport); an error row's reason
    latency_s: float = 0.0


class Generator(Protocol):
    """What regeneration asks of an engine replica (actors/regenerator.py)."""

    name: str
    start_attempts: int

    def start(self) -> Generator: ...

    def close(self) -> None: ...

    def ensure_alive(self) -> None: ...

    def submit_generate(self, key: str, ids: list[int], sampling: dict) -> Future:
        """Queue one generation (sampling: temperature, top_p, max_new_tokens, seed); the future gives its
        GenerateResult. Thread-safe; no hidden states are captured for it."""


class Engine(Protocol):
    name: str
    # How many times start() tries before it gives up, each within engine.startup_timeout_s: the driver
    # waits for the actors' constructors that long.
    start_attempts: int

    def start(self) -> Engine: ...

    def close(self) -> None: ...

    def ensure_alive(self) -> None:
        """Raise EngineDied if the engine cannot serve (after restarting what it can restart)."""

    def submit(self, key: str, ids: list[int], order: float = 0.0) -> Future:
        """Queue one request; the future gives its RequestResult. `order`: the caller batch's age."""

    def stats(self) -> dict:
        """Counters so far (forwards, tokens, seconds), reported in the manifest; {} where none are kept."""


# engine.name -> "module:Class", imported on first use: the driver never imports an engine's heavy
# dependencies (SGLang, torch) just to plan a run.
_REGISTRY: dict[str, str] = {}
# The same names for generation: SGLang generates through its own server; transformers through generate().
_GENERATORS: dict[str, str] = {}


def register(name: str, target: str, generator: str | None = None) -> None:
    _REGISTRY[name] = target
    if generator is not None:
        _GENERATORS[name] = generator


def _load(registry: dict[str, str], name: str) -> type:
    try:
        module, _, cls = registry[name].partition(":")
    except KeyError:
        raise ValueError(f"engine.name {name!r} is not an engine; choose one of {sorted(registry)}") from None
    return getattr(importlib.import_module(module), cls)


def engine_class(name: str) -> type:
    return _load(_REGISTRY, name)


def generator_class(name: str) -> type:
    return _load(_GENERATORS, name)


register("sglang", "actors.sglang.engine:SGLangEngine", generator="actors.sglang.engine:SGLangEngine")
register("hf", "actors.hf.engine:HFEngine", generator="actors.hf.generator:HFGenerator")

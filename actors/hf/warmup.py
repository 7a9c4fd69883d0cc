"""The hf engine's warm-up: one full forward of max_batch_tokens before the engine counts as started.

The device's kernels load, its memory pool and the pinned staging buffers grow to size, and a
max_batch_tokens the device cannot hold fails here, at start, instead of splitting every large forward of a
job (the out-of-memory fallback). SGLang's server warms up before it reports ready in the same way, and the
benchmarks time warmed engines on both sides. It goes through the engine's public requests like any caller.
"""

from __future__ import annotations

import logging

logger = logging.getLogger(__name__)


def warm_up(engine) -> None:
    """The full forward (on CUDA padded, also the host's launch time of a small one, for the start-up
    line), then the engine's counters from zero."""
    length = min(engine.max_batch_tokens, engine.WARMUP_MAX_LENGTH)
    n = max(1, engine.max_batch_tokens // length)
    futures = engine.submit_together(
        [(f"warm-up-{i}", [i % engine.vocab_size] * length) for i in range(n)], order=float("-inf")
    )
    for f in futures:
        res = f.result()
        if res.capture is not None:
            res.capture.release()
        if res.error:
            raise RuntimeError(f"hf engine warm-up ({n} x {length} tokens) failed: {res.error}")
    if engine.batches != 1:
        raise RuntimeError(
            f"engine.max_batch_tokens={engine.max_batch_tokens} does not fit on {engine.device}: a forward of {n} x "
            f"{length} tokens ran out of memory; lower engine.max_batch_tokens"
        )
    if engine.cuda and engine.packed:
        logger.info(
            "hf engine: packed forwards of %d tokens, the device runs %.1f us a token",
            engine.max_batch_tokens,
            1e6 * engine.timing["device_forward"] / max(engine.padded_tokens, 1),
        )
    elif engine.cuda:
        per_token = engine.timing["device_forward"] / max(engine.padded_tokens, 1)
        launch = launch_seconds(engine)
        # Its forwards (the full one, the small ones) were observed as they finished (the device clock).
        logger.info(
            "hf engine: the host launches a forward in %.0f ms, the device runs %.1f us a padded token: "
            "forwards fill to %d tokens before the padding cap applies",
            1000 * launch,
            1e6 * per_token,
            engine.min_fill * engine.max_batch_tokens,
        )
    engine.reset_stats()


def launch_seconds(engine, length: int = 256) -> float:
    """The host's time to launch one small forward (the best of two, each alone): on CUDA nothing in a
    forward waits for the device, so this is the Python and launch work every forward costs."""
    took = []
    for i in range(2):
        before = engine.timing["forward"]
        res = engine.submit(
            f"warm-up-launch-{i}", [i % engine.vocab_size] * min(length, engine.max_batch_tokens)
        ).result()
        if res.capture is not None:
            res.capture.release()
        if res.error:
            raise RuntimeError(f"hf engine warm-up (one forward of {length} tokens) failed: {res.error}")
        took.append(engine.timing["forward"] - before)
    return min(took)

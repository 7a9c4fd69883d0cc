"""The benchmarks' baseline: the hf engine with nothing kept.

The same batching, forwards, worker and finisher threads and the same device clock as the capturing
engine (actors/hf/engine.py), without the capture: its `outputs="discard"` mode keeps no hooked outputs,
stages and copies nothing, and resolves each request with no capture once its forward has run
(actors/hf/outputs.py, DiscardOutputs). What a job costs beyond this is what capturing, validating,
encoding and committing cost.
"""

from __future__ import annotations

import time

from actors.hf.engine import HFEngine


class BareHFEngine(HFEngine):
    """HFEngine(outputs="discard") with torch's own attention kernel choice: the baseline at its best, whose
    per-shape cuDNN plans are all built by a repeated pass over the same prompts (the passes the benchmarks
    take the best of)."""

    def __init__(self, *args, cudnn_attention: str = "always", **kwargs):
        super().__init__(*args, cudnn_attention=cudnn_attention, outputs="discard", **kwargs)


def plain_loop(model_dir: str, prompts: list[list[int]], batch_tokens: int, device: str, passes: int = 2) -> dict:
    """A plain transformers loop, nothing of the engine's: the prompts sorted by length, cut into batches of
    at most `batch_tokens` padded tokens, right-padded without a mask, each batch's decoder forward in turn
    (no LM head, nothing read back), one synchronize at the end; best of `passes` passes after a warm-up
    over one row of every eighth batch. The rate a user gets from the simplest script."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16, attn_implementation="sdpa")
    base = model.get_decoder().to(device).eval()
    del model
    order = sorted(prompts, key=len, reverse=True)
    batches, i = [], 0
    while i < len(order):
        rows = max(1, batch_tokens // len(order[i]))
        batches.append(order[i : i + rows])
        i += rows
    padded = sum(len(b) * len(b[0]) for b in batches)
    tokens = sum(map(len, prompts))

    def run(part) -> float:
        t0 = time.monotonic()
        with torch.inference_mode():
            for b in part:
                ids = torch.zeros((len(b), len(b[0])), dtype=torch.long)
                for row, seq in enumerate(b):
                    ids[row, : len(seq)] = torch.tensor(seq)
                base(input_ids=ids.to(device), use_cache=False)
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        return time.monotonic() - t0

    run([b[:1] for b in batches[:: max(1, len(batches) // 8)]])  # warm-up: kernels, allocator
    seconds = [run(batches) for _ in range(passes)]
    base = None  # the weights go before the next baseline loads its own
    if device.startswith("cuda"):
        torch.cuda.empty_cache()
    return {
        "batch_tokens": batch_tokens,
        "forwards": len(batches),
        "padding": round(padded / tokens - 1, 4),
        "passes_tok_s": [round(tokens / s, 1) for s in seconds],
        "tok_s": round(tokens / min(seconds), 1),
    }

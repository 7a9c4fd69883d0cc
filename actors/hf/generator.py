"""Regeneration with transformers' `generate`, in the actor's own process: where SGLang does not run.

One worker thread takes requests in order and generates one conversation turn at a time. That is far from
a serving engine's throughput (no continuous batching), but it needs nothing beyond transformers, and a
request's seed then decides its sample exactly (torch's generator is seeded before each request, which a
batch of requests with seeds of their own could not do). The model runs in bfloat16 on a GPU and in
float32 on the CPU, where bf16 matmul is slow without native support (actors/sglang/server.py).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from concurrent.futures import Future

from actors.engine import EngineDied, GenerateResult

logger = logging.getLogger(__name__)


class HFGenerator:
    name = "hf"
    start_attempts = 1

    @classmethod
    def generation_kwargs(cls, cfg, model_dir: str, cuda: bool, cpu_threads: int, in_flight: int) -> dict:
        """Constructor arguments from the engine's config section (conf.schema.HFEngineConfig)."""
        return {"model_dir": model_dir, "device": "cuda" if cuda else "cpu", "cpu_threads": cpu_threads}

    def __init__(self, model_dir: str, device: str = "cpu", cpu_threads: int | None = None):
        self.model_dir, self.device, self.cpu_threads = str(model_dir), device, cpu_threads
        self._queue: queue.Queue = queue.Queue()
        self._worker: threading.Thread | None = None
        self._failure: BaseException | None = None
        self.model = self.tok = None

    def start(self) -> HFGenerator:
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        if self.device == "cpu" and self.cpu_threads:
            torch.set_num_threads(self.cpu_threads)
        dtype = torch.bfloat16 if self.device.startswith("cuda") else torch.float32
        self.tok = AutoTokenizer.from_pretrained(self.model_dir)
        self.model = AutoModelForCausalLM.from_pretrained(self.model_dir, dtype=dtype).to(self.device).eval()
        eos = self.model.generation_config.eos_token_id
        self.eos = set(eos if isinstance(eos, list) else [eos] if eos is not None else [])
        self._worker = threading.Thread(target=self._loop, name="hf-generate", daemon=True)
        self._worker.start()
        return self

    def close(self) -> None:
        if self._worker is not None:
            self._queue.put(None)
            self._worker.join(timeout=30)
            self._worker = None

    def __enter__(self) -> HFGenerator:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()

    def ensure_alive(self) -> None:
        if self._failure is not None or self._worker is None or not self._worker.is_alive():
            raise EngineDied(f"hf generator is not running: {self._failure!r}")

    def submit_generate(self, key: str, ids: list[int], sampling: dict) -> Future:
        self.ensure_alive()
        fut: Future = Future()
        self._queue.put((fut, key, list(ids), dict(sampling)))
        return fut

    def _loop(self) -> None:
        while (item := self._queue.get()) is not None:
            fut, key, ids, sampling = item
            try:
                fut.set_result(self._generate(key, ids, sampling))
            except Exception as e:  # noqa: BLE001 -- one request's failure is that request's error row
                logger.warning("hf generate failed for %s: %s", key, e)
                fut.set_result(GenerateResult(key, [], "", "", f"generate failed: {type(e).__name__}: {e}"))

    def _generate(self, key: str, ids: list[int], sampling: dict) -> GenerateResult:
        import torch

        t0 = time.monotonic()
        sample = sampling["temperature"] > 0
        kwargs = {"do_sample": sample, "max_new_tokens": sampling["max_new_tokens"]}
        if sample:
            kwargs.update(temperature=sampling["temperature"], top_p=sampling["top_p"])
            torch.manual_seed(int(sampling.get("seed") or 0))
        else:
            kwargs.update(temperature=None, top_p=None, top_k=None)
        with torch.inference_mode():
            x = torch.tensor([ids], device=self.device)
            out = self.model.generate(
                x, attention_mask=torch.ones_like(x), pad_token_id=self.tok.pad_token_id, **kwargs
            )
        new = out[0, len(ids) :].tolist()
        if new and new[-1] in self.eos:
            finish = "stop"
        else:
            finish = "length" if len(new) >= sampling["max_new_tokens"] else "stop"
        text = self.tok.decode(new, skip_special_tokens=True)
        return GenerateResult(key, new, text, finish, None, time.monotonic() - t0)

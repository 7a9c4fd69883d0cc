"""The in-process transformers engine: the same contract as the SGLang engine, no server.

`submit(key, ids)` is thread-safe and returns a Future of a RequestResult whose capture carries the same
header and byte-plane body a SGLang dump does (actors/dump.py), so validation, encoding and shards are
the same code for both engines. One worker thread owns the model:

- Requests wait in one pool; each forward takes the longest request of the oldest caller batch and the
  next ones by length up to `max_batch_tokens` padded tokens, stopping where padding would pass a small
  share of the real tokens (actors/hf/batching.py), or, packed, the requests end to end in one row
  (actors/hf/packing.py, checked at start by actors/hf/pack_check.py). Padded rows run without an attention
  mask: under causal attention a real token only sees earlier positions, which are all real, so its states
  are exactly those of the unpadded sequence. Padded positions are never copied.
- Nothing in a forward waits for the device, so the host launches the next forward while the device
  runs this one: transformers' one readback per forward (its packed-sequence check) is answered for these
  rows (actors/hf/decoder.py, which also holds the hooks that keep what is stored).
- What becomes of a forward's outputs is the `outputs` strategy (actors/hf/outputs.py): captured (staged
  as the codec's byte planes on the device, actors/hf/staging.py) or, for the benchmarks' baseline,
  discarded. On CUDA a finisher thread copies each batch to pinned memory and resolves its futures while
  the next batch already runs (actors/hf/host_copy.py), and a device clock times the forwards
  (actors/hf/device_clock.py).
- On CUDA, start() runs one full forward of `max_batch_tokens` before it returns (actors/hf/warmup.py): a
  size the device cannot hold is refused at start, and the job's first batches do not pay for kernel
  loading and memory pools growing.

Float states without the capture format (the audit's reference) are actors/hf/reference.py's.
`stats()` says where the worker threads' time went (idle, forward, staging, waiting on copies) and, on
CUDA, the device's own; it is logged when the engine closes.
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import Future, as_completed
from statistics import median

from actors.engine import EngineDied, RequestResult
from actors.hf import pack_check, warmup
from actors.hf.batching import BatchPolicy, FillFloor, take_batch, take_packed
from actors.hf.decoder import Decoder
from actors.hf.device_clock import DeviceClock
from actors.hf.host_copy import HostCopier
from actors.hf.outputs import Request, Staged, outputs_for
from actors.hf.settings import HFEngineSettings
from actors.hf.staging import TritonStager, stage_fp8, stage_torch

logger = logging.getLogger(__name__)


class HFEngine(HFEngineSettings):
    start_attempts = 1  # a model load that fails fails again: nothing to retry
    WARMUP_MAX_LENGTH = 2048  # the warm-up's sequences: max_batch_tokens in as many of these as fit
    # The fill floor on CUDA unless debug.fill_floor says otherwise: every forward filled to max_batch_tokens
    # whatever its padding. Each forward costs the host a launch and, inside a job, some device time waiting
    # on it, so fewer, fuller forwards beat less padding (bench/results/benchmix_fill_floor_full_h200.json,
    # longtail_fill_floor_full_h200.json).
    CUDA_FILL_FLOOR = 1.0
    # The device sat idle before a forward when more than this passed between the previous forward's end and
    # this one's first layer (its ids' copy and the embedding take well under it).
    DEVICE_WAITED_MS = 0.5
    # Pinned slabs of the largest batch (actors/hf/host_copy.py) unless debug.pinned_slabs says otherwise:
    # two in the finisher's hands, the rest held by captures the actor has not encoded yet. Past this many a
    # batch allocates its own, counted in stats().
    PINNED_SLABS = 8

    def __init__(
        self,
        model_dir: str,
        aux_layers: tuple[int, ...],
        device: str = "cpu",
        max_batch_tokens: int = 8192,
        cpu_threads: int | None = None,
        attn_implementation: str = "sdpa",
        warmup: bool | None = None,
        final_layer: str = "post_norm",
        capture_layout: str = "planes",
        fill_floor: float | str | None = None,
        packing: str | None = None,
        cudnn_attention: str = "warm",
        forward_log: str | None = None,
        pinned_slabs: int | None = None,
        outputs: str = "capture",
    ):
        """`outputs`: "capture" (the job's) or "discard" (the benchmarks' baseline: the same forwards, nothing
        kept, staged or copied; actors/hf/outputs.py). `forward_log`, `pinned_slabs`, `fill_floor` and
        `cudnn_attention` are the debug section's (conf/schema.py, DebugConfig)."""
        if capture_layout not in ("planes", "fp8"):
            raise ValueError(f"capture_layout {capture_layout!r}: planes or fp8")
        if packing not in ("auto", "on", "off", None):
            raise ValueError(f"packing {packing!r}: auto, on, off or None")
        self.model_dir = str(model_dir)
        self.aux_layers = tuple(aux_layers)
        self.device = device
        self.final_layer = final_layer
        self.capture_layout = capture_layout
        self.decoder = Decoder(
            self.model_dir,
            self.aux_layers,
            device,
            self.dtype,
            attn_implementation,
            final_layer,
            cudnn_attention=cudnn_attention,
        )
        self.cuda = device.startswith("cuda")
        self.outputs = outputs_for(outputs, self.decoder, capture_layout, final_layer, self.dtype, self.cuda)
        self.max_batch_tokens = max_batch_tokens
        # debug.fill_floor: a share of max_batch_tokens, "measured" (on CUDA from the warm-up, then from every
        # forward of the job: batching.FillFloor), or None for the device's default. Here None is the measured
        # floor, which on a CPU stays at its minimum (nothing there measures it).
        if fill_floor == "measured":
            self.fill_floor = None
        elif fill_floor is None:
            self.fill_floor = self.CUDA_FILL_FLOOR if self.cuda else None
        else:
            self.fill_floor = float(fill_floor)
        self._floor = FillFloor(max_batch_tokens)
        self.packing = self.packing_for(packing, self.cuda)
        self.packed = False  # decided in start() (pack_check.choose)
        self.cpu_threads = cpu_threads
        self.warmup = warmup  # None: on CUDA only
        self._pending: list[Request] = []
        self._cv = threading.Condition()
        self._closing = False
        self._worker: threading.Thread | None = None
        self._failure: BaseException | None = None
        # On CUDA, start() puts the Triton kernel here where it matches; fp8 quantizes with torch ops.
        self.stager = stage_fp8 if capture_layout == "fp8" else stage_torch
        self.batches = 0
        self.padded_tokens = 0
        self.real_tokens = 0
        # Where the worker threads' time goes (seconds): a device that waits shows up here, not as an error.
        self.timing = dict.fromkeys(("idle", "forward", "stage", "pin_alloc", "handoff", "copy_wait", "resolve"), 0.0)
        self.clock: DeviceClock | None = None
        self.copier: HostCopier | None = None
        if self.cuda:  # nothing here touches the device before start()
            self.clock = DeviceClock(self.timing, forward_log)
            slabs = self.PINNED_SLABS if pinned_slabs is None else pinned_slabs
            self.copier = HostCopier(self.timing, max_batch_tokens, capture_layout, slabs, self._observe, self._resolve)
        # Wall clock of the first forward's start and of the last batch's results: with the job's own clock
        # they split a run into waiting for work, the device's span and what came after it.
        self.first_forward_unix: float | None = None
        self.last_done_unix: float | None = None
        self.phases: dict = {}  # where start() went: load_s and its load_parts_s, warm_up_s

    # ---- lifecycle -------------------------------------------------------------------------------

    def start(self) -> HFEngine:
        import torch

        if self.device == "cpu" and self.cpu_threads:
            torch.set_num_threads(self.cpu_threads)
        t0 = time.monotonic()
        self.decoder.load()
        weights = time.monotonic()
        self.packed = pack_check.choose(self.decoder, self.packing)
        checked = staged = time.monotonic()
        if self.cuda:
            # One kernel launch per layer instead of a few hundred small torch ops on the forward thread
            # (actors/hf/staging.py); checked against the torch ops here, and they stay where it does not match.
            if self.capture_layout == "planes":
                self.stager = TritonStager.checked(self.device) or stage_torch
            staged = time.monotonic()
            self.clock.start(self.decoder)
            self.copier.start()
        self._worker = threading.Thread(target=self._work_loop, name="hf-engine-forward", daemon=True)
        self._worker.start()
        loaded = time.monotonic()
        if self.cuda if self.warmup is None else self.warmup:
            try:
                warmup.warm_up(self)
            except BaseException:
                self.close()
                raise
        self.phases = {
            "load_s": round(loaded - t0, 3),
            # Where the load went (the start-up line prints them): the model's import, read and move to the
            # device (Decoder.load), the packed-against-padded check where packing was asked for, and on
            # CUDA the staging kernel's check (its compile).
            "load_parts_s": {
                **self.decoder.load_parts,
                **({"packing check": round(checked - weights, 3)} if self.packing != "off" else {}),
                **({"staging check": round(staged - checked, 3)} if self.cuda else {}),
            },
            "warm_up_s": round(time.monotonic() - loaded, 3),
        }
        logger.info(
            "hf engine: %s on %s in %s, ready in %.1fs", self.model_dir, self.device, self.dtype, time.monotonic() - t0
        )
        return self

    @property
    def min_fill(self) -> float:
        """The fill floor in force: debug.fill_floor where it fixes one, else the measured one."""
        return self.fill_floor if self.fill_floor is not None else self._floor.share

    @property
    def policy(self) -> BatchPolicy:
        return BatchPolicy(self.max_batch_tokens, min_fill=self.min_fill)

    @property
    def base(self):
        """The transformers decoder (after start())."""
        return self.decoder.base

    @property
    def vocab_size(self) -> int:
        return self.decoder.vocab_size

    def reset_stats(self) -> None:
        """Counters from zero (after a warm-up); call with no request in flight."""
        self.batches = self.padded_tokens = self.real_tokens = 0
        for k in self.timing:  # in place: the clock and the finisher add to this dict
            self.timing[k] = 0.0
        self.first_forward_unix = self.last_done_unix = None
        if self.copier is not None:
            self.copier.reset()
        if self.clock is not None:
            self.clock.reset()

    def stats(self) -> dict:
        """Counters so far: forwards, tokens (real and padded), the forward/finisher threads' seconds and
        the wall clock of the first forward and of the last results."""
        slabs = self.copier.slabs if self.copier is not None else None
        return {
            "forwards": self.batches,
            "real_tokens": self.real_tokens,
            "padded_tokens": self.padded_tokens,
            "packed": self.packed,
            "staging": "triton" if isinstance(self.stager, TritonStager) else f"torch ({self.capture_layout})",
            # How this actor's CPU ran the bf16 products (bf16_gemms.py): the driver's provenance cannot say,
            # since in a cluster the actor's CPU need not be the driver's.
            **({} if self.cuda else {"products": "float32" if self.decoder.float32_gemms else "bfloat16"}),
            **{f"{k}_s": round(v, 3) for k, v in self.timing.items()},
            **({"lead_under_a_layer": self.clock.lead_under_a_layer} if self.clock is not None else {}),
            "fill_floor_tokens": int(self.min_fill * self.max_batch_tokens),
            **({"fill_floor_launch_ms": round(1000 * median(self._floor.launch_s), 1)} if self._floor.launch_s else {}),
            # Batches that found no free pinned slab and allocated their own (CUDA).
            **({"pinned_slabs": slabs.allocated, "pinned_misses": slabs.misses} if slabs else {}),
            **({"device_allocator": self.clock.allocator_since_reset()} if self.clock is not None else {}),
            "first_forward_unix": self.first_forward_unix,
            "last_done_unix": self.last_done_unix,
            "start": dict(self.phases),
        }

    def close(self) -> None:
        if self.batches:
            logger.info("hf engine: %s", self.stats())
        with self._cv:
            self._closing = True
            self._cv.notify_all()
        if self._worker is not None:
            self._worker.join(timeout=60)
        if self.copier is not None:
            self.copier.close()
        if self.clock is not None:
            self.clock.close()
        self.decoder.close()
        self._worker = None
        with self._cv:
            for r in self._pending:
                r.future.set_result(RequestResult(r.key, None, "engine closed before the request ran", 0.0))
            self._pending.clear()

    def __enter__(self) -> HFEngine:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()

    def healthy(self) -> bool:
        return self._worker is not None and self._worker.is_alive() and self._failure is None

    def ensure_alive(self) -> None:
        if not self.healthy():
            raise EngineDied(f"hf engine worker is not running: {self._failure!r}")

    # ---- requests --------------------------------------------------------------------------------

    def submit(self, key: str, ids: list[int], order: float = 0.0) -> Future:
        """Queue one request; the Future gives its RequestResult. Thread-safe.

        `order`: requests sharing it form one caller batch; the lowest order is served first (see take)."""
        fut: Future = Future()
        if self._worker is None:
            raise EngineDied("engine is not started")
        bad = next((t for t in ids if not 0 <= t < self.vocab_size), None)
        if not ids or bad is not None:
            # Checked here: on CUDA an out-of-range embedding index is a device assert that ends the process.
            why = "no tokens" if not ids else f"token id {bad} outside the vocabulary 0..{self.vocab_size - 1}"
            fut.set_result(RequestResult(key, None, why, 0.0))
            return fut
        with self._cv:
            self._pending.append(Request(key, list(ids), fut, time.monotonic(), order))
            self._cv.notify()
        return fut

    def submit_together(self, requests: list[tuple[str, list[int]]], order: float = 0.0) -> list[Future]:
        """Queue every request before the worker takes any, so they are one pool for `take`."""
        with self._cv:  # the worker needs the lock to take
            return [self.submit(key, ids, order=order) for key, ids in requests]

    def capture(self, requests: list[tuple[str, list[int]]]) -> dict[str, RequestResult]:
        """Every request at once; results keyed by the caller's key."""
        futures = [self.submit(key, ids) for key, ids in requests]
        return {r.key: r for r in (f.result() for f in as_completed(futures))}

    def take(self, pool: list[Request]) -> list[Request]:
        """The waiting requests the next forward runs, taken out of `pool` (actors/hf/batching.py); called
        on the worker thread with the pool's lock held. A benchmark may override it to replay given batches."""
        return take_packed(pool, self.max_batch_tokens) if self.packed else take_batch(pool, self.policy)

    # ---- the worker ------------------------------------------------------------------------------

    def _forward(self, batch: list[Request]):
        self.batches += 1
        if self.first_forward_unix is None:
            self.first_forward_unix = time.time()
        # Pinned on CUDA: from pageable memory CUDA would first wait for the device to go idle, and the next
        # forward could only be launched once the GPU had run dry.
        ids = self.decoder.forward([r.ids for r in batch], keep=self.outputs.keeps, pin=self.cuda, packed=self.packed)
        self.padded_tokens += ids.size
        self.real_tokens += sum(len(r.ids) for r in batch)
        return ids

    def _work_loop(self) -> None:
        try:
            while True:
                t0 = time.monotonic()
                with self._cv:
                    while not self._pending and not self._closing:
                        self._cv.wait()
                    if self._closing:
                        return
                    batch = self.take(self._pending)
                self.timing["idle"] += time.monotonic() - t0
                self._run(batch)
        except BaseException as e:  # noqa: BLE001 - reported through ensure_alive and every waiting future
            self._failure = e
            logger.exception("hf engine worker failed")
            with self._cv:
                for r in self._pending:
                    r.future.set_result(RequestResult(r.key, None, f"engine failed: {e!r}", 0.0))
                self._pending.clear()

    def _run(self, batch: list[Request]) -> None:
        import torch

        if self.clock is not None:
            self.clock.begin()
        try:
            t0, start_unix = time.monotonic(), time.time()
            ids = self._forward(batch)
            t1 = time.monotonic()
            staged = self.outputs.stage(batch, ids, self.packed, self.stager)
            if self.clock is not None:
                self.clock.mark("end")  # the finisher waits on it: the copy queues behind the staging
            host_forward_s = t1 - t0
            self.timing["forward"] += host_forward_s
            self.timing["stage"] += time.monotonic() - t1
        except torch.cuda.OutOfMemoryError as e:
            self.decoder.discard()
            if len(batch) == 1:
                batch[0].future.set_result(RequestResult(batch[0].key, None, f"out of memory: {e}", 0.0))
                return
            torch.cuda.empty_cache()
            logger.warning("out of memory on a batch of %d; running its requests one by one", len(batch))
            for r in batch:
                self._run([r])
            return
        except Exception as e:  # noqa: BLE001 - one batch's failure is its requests' error rows
            self.decoder.discard()
            for r in batch:
                r.future.set_result(RequestResult(r.key, None, f"forward failed: {type(e).__name__}: {e}", 0.0))
            return
        if self.copier is not None:
            t0 = time.monotonic()
            marks = self.clock.take()
            marks.update(host_forward_s=host_forward_s, host_start_unix=start_unix)
            self.copier.put(staged, marks)  # blocks while the previous batch's copy is still pending: two in flight
            self.timing["handoff"] += time.monotonic() - t0
        else:
            self._resolve(staged)

    def _observe(self, marks: dict, staged: Staged) -> None:
        """One batch's device clock (on the finisher, its copy done); the measured fill floor follows what
        launching a forward costs inside the job."""
        seen = self.clock.observe(marks, staged)
        if seen is None:
            return
        forward_ms, between_ms = seen
        self._floor.observe(
            marks.get("host_forward_s", 0.0),
            forward_ms / 1000,
            staged.ids.size,
            # Only a forward the device waited for was launched onto an idle device (batching.FillFloor).
            device_waited=between_ms is None or between_ms > self.DEVICE_WAITED_MS,
        )

    def _resolve(self, staged: Staged) -> None:
        self.last_done_unix = time.time()
        self.outputs.resolve(staged)

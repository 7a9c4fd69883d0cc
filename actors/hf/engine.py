"""The in-process transformers engine: the same contract as the SGLang engine, no server.

`submit(key, ids)` is thread-safe and returns a Future of a RequestResult whose capture carries the same
header and byte-plane body a SGLang dump does (actors/dump.py), so validation, encoding and shards are
the same code for both engines. One worker thread owns the model:

- Requests wait in one pool; each forward takes the longest request of the oldest caller batch and the
  next ones by length up to `max_batch_tokens` padded tokens, stopping where padding would pass 3 % of the
  real tokens (actors/hf/batching.py). Sequences are right-padded and run
  without an attention mask: under causal attention a real token only sees earlier positions, which are
  all real, so its states are exactly those of the unpadded sequence. Padded positions are never copied.
- Nothing in a forward waits for the device, so the host launches the next forward while the device
  runs this one: transformers' one readback per forward (its packed-sequence check) is answered for these
  rows (actors/hf/decoder.py, which also holds the hooks that keep what is stored).
- On CUDA each request's states are split into the codec's byte planes and counted for non-finite values
  on the device (actors/hf/staging.py: one Triton kernel launch per layer, or torch ops where the kernel is
  not usable), and the forward thread goes on to the next forward. A finisher thread allocates pinned
  memory, copies the batch into it in one asynchronous transfer on a side stream, waits for that copy and
  resolves the futures while the next batch already runs. At most two batches wait for the finisher,
  which bounds device and pinned memory.
- On CUDA, start() runs one full forward of `max_batch_tokens` before it returns (`_warm_up`): a size the
  device cannot hold is refused at start, and the job's first batches do not pay for kernel loading and
  memory pools growing.

Float states without the capture format (the audit's reference) are actors/hf/reference.py's.
`stats()` says where the worker threads' time went (idle, forward, staging, waiting on copies) and, on
CUDA, the device's own (its forwards, the staging, the time between batches); it is logged when the
engine closes. Inside a forward the device clock reads every decoder layer's start: every layer of a
uniform stack does the same work, so the seconds its layers ran beyond the forward's median layer are
the device waiting inside the forward (on the host's kernel launches, a sync, the allocator), and the
layers whose start the device had already passed when the host reached the next one say the host was
less than a layer ahead (`lead_under_a_layer`). With HIDDEN_HARVEST_FORWARD_LOG set to a directory, each
forward's shape and clock go to a JSON-lines file there (one per process), for benchmarks to replay.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import queue
import threading
import time
from concurrent.futures import Future, as_completed
from dataclasses import dataclass
from statistics import median

import numpy as np

from actors.dump import Capture, CaptureHeader
from actors.engine import EngineDied, RequestResult
from actors.hf.batching import BatchPolicy, FillFloor, take_batch, take_packed
from actors.hf.decoder import Decoder
from actors.hf.pinned import PinnedSlabs
from actors.hf.staging import (
    TritonStager,
    body_per_token,
    packed_starts,
    padded_starts,
    plane_offsets,
    stage_fp8,
    stage_torch,
)

logger = logging.getLogger(__name__)


@dataclass
class _Request:
    key: str
    ids: list[int]
    future: Future
    submitted: float
    order: float = 0.0  # requests of one caller batch share it; lower goes first


@dataclass
class _Staged:
    """One forward's capture on its way to the host: every request's byte planes in one uint8 buffer
    (`offsets[i]:offsets[i + 1]` is request i's), the non-finite count per padded position, and the widths
    (K*H, H). On CUDA `planes` and `nonfinite` are device tensors until the finisher has copied them."""

    batch: list[_Request]
    ids: np.ndarray  # the ids the forward ran: [B, T] padded rows or [1, N] packed
    starts: np.ndarray | None = None  # request i's first position in ids.reshape(-1) (None: nothing staged)
    planes: object = None
    offsets: np.ndarray | None = None
    nonfinite: object = None
    widths: tuple[int, int] = (0, 0)


def _ids_sha256(ids: np.ndarray) -> str:
    # The same digest the SGLang hook publishes: sha256 over the int32 ids the forward really ran.
    return hashlib.sha256(np.ascontiguousarray(ids, dtype=np.int32).tobytes()).hexdigest()


def _request_starts(lengths: list[int], shape: tuple[int, ...], packed: bool) -> np.ndarray:
    """Each request's first position in a forward's [B*T] positions: end to end when packed, else row * T."""
    return packed_starts(lengths) if packed else padded_starts(shape[0], shape[1])


FORWARD_LOG_ENV = "HIDDEN_HARVEST_FORWARD_LOG"
PINNED_SLABS_ENV = "HIDDEN_HARVEST_PINNED_SLABS"


def _allocator_counts() -> dict:
    """Counters of torch's CUDA caching allocator that say the device's memory was mapped or unmapped."""
    import torch

    if not torch.cuda.is_initialized():  # nothing allocated yet (and no device to ask on a CPU host)
        return {}
    stats = torch.cuda.memory_stats()
    return {
        "device_mallocs": int(stats.get("num_device_alloc", 0)),
        "device_frees": int(stats.get("num_device_free", 0)),
        "alloc_retries": int(stats.get("num_alloc_retries", 0)),
        "cache_flushes": int(stats.get("num_sync_all_streams", 0)),
    }


def layer_ms(layers: list, norm) -> list[float]:
    """Each layer's device milliseconds, from the events recorded at every layer's start and at the final norm."""
    return [a.elapsed_time(b) for a, b in zip(layers, [*layers[1:], norm])]


def layer_excess_ms(layers: list, norm) -> float:
    """Device milliseconds a forward's layers ran beyond its median layer's time, from the events recorded
    at each layer's start and at the final norm: every layer of a uniform stack does the same work, so this
    is time the device spent waiting inside the forward (for MoE stacks with dense layers it also holds
    their real difference)."""
    ms = layer_ms(layers, norm)
    return sum(ms) - len(ms) * float(np.median(ms)) if ms else 0.0


def slow_layers(layers: list, norm, over_ms: float = 1.0) -> list[list]:
    """[index, ms beyond the median layer] of each layer that ran `over_ms` or more beyond it."""
    ms = layer_ms(layers, norm)
    if not ms:
        return []
    mid = float(np.median(ms))
    return [[i, round(t - mid, 2)] for i, t in enumerate(ms) if t - mid >= over_ms]


class HFEngine:
    name = "hf"
    start_attempts = 1  # a model load that fails fails again: nothing to retry
    WARMUP_MAX_LENGTH = 2048  # the warm-up's sequences: max_batch_tokens in as many of these as fit
    # The fill floor on CUDA unless engine.fill_floor says otherwise: every forward filled to max_batch_tokens
    # whatever its padding. Each forward costs the host a launch and, inside a job, some device time waiting
    # on it; fewer, fuller forwards beat less padding on both H200 mixes, one run each with the bare engine:
    # benchmark mix 0.945 of it (95 forwards, 2.9 % padding) against 0.930 measured (123 forwards, 1.5 %) and
    # 0.931 at half the budget; long-tailed mix 0.883 (65 forwards, 5.5 %) against 0.879 measured (107, 2.2 %)
    # (bench/results/benchmix_fill_floor_full_h200.json, longtail_fill_floor_full_h200.json; the bare engine
    # ran with its measured floor there).
    CUDA_FILL_FLOOR = 1.0
    # The device sat idle before a forward when more than this passed between the previous forward's end and
    # this one's first layer (its ids' copy and the embedding take well under it).
    DEVICE_WAITED_MS = 0.5
    # Pinned slabs of the largest batch (actors/hf/pinned.py): two in the finisher's hands, the rest held by
    # captures the actor has not encoded yet. Past this many a batch allocates its own, counted in stats().
    # HIDDEN_HARVEST_PINNED_SLABS overrides it for benchmarks (0: every batch allocates, as before the slabs).
    # All of them are pinned at the warm-up: one grown mid-run (~0.5 GB for 16k tokens of a 4096-wide model with
    # three aux layers) took ~1 s of the driver's lock from the forward thread, and with the fill floor's larger
    # forwards the H200's long-tailed mix grew 4 slabs and missed 4 times: 6.0 s of allocation, 4.5 s of device
    # idle between forwards (bench/results/longtail_adaptive_floor_h200.json).
    PINNED_SLABS = 8

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
        max_prompt_tokens: int | None = None,
    ) -> dict:
        """Constructor arguments from the engine's config section (conf.schema.HFEngineConfig).
        `max_prompt_tokens` is not needed here: this engine allocates per batch, by max_batch_tokens."""
        return {
            "model_dir": model_dir,
            "aux_layers": tuple(aux_layers),
            "final_layer": final_layer,
            "capture_layout": capture_layout,
            "device": "cuda" if cuda else "cpu",
            "max_batch_tokens": cfg.max_batch_tokens,
            "cpu_threads": cpu_threads,
            "fill_floor": cfg.fill_floor,
            "packing": cfg.packing,
            "cudnn_attention": cfg.cudnn_attention,
        }

    @classmethod
    def provenance(cls, kwargs: dict, cuda: bool) -> dict:
        from importlib.metadata import version

        return {
            "name": cls.name,
            "version": f"transformers {version('transformers')}",
            "device": kwargs["device"],
            "dtype": "bfloat16",
            "max_batch_tokens": kwargs["max_batch_tokens"],
            **({"cudnn_attention": kwargs["cudnn_attention"]} if cuda else {}),
            "packing": cls.packing_for(kwargs["packing"], cuda),
        }

    @staticmethod
    def packing_for(packing: str | None, cuda: bool) -> str:
        """engine.packing, None being the device's default (conf/schema.py): packed where the model allows on
        CUDA, padded on a CPU."""
        return packing or ("auto" if cuda else "off")

    # Captures are stored as bf16, and the model runs in it (a float reference is reference.py's).
    dtype = "bfloat16"
    _keeps = True  # the hooks keep each forward's outputs for _stage (the benchmark's bare engine keeps none)

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
    ):
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
        self.max_batch_tokens = max_batch_tokens
        # engine.fill_floor: a share of max_batch_tokens, "measured" (on CUDA from the warm-up, then from
        # every forward of the job: batching.FillFloor), or None for the device's default. Here None is the
        # measured floor, which on a CPU stays at its minimum (nothing there measures it).
        if fill_floor == "measured":
            self.fill_floor = None
        elif fill_floor is None:
            self.fill_floor = self.CUDA_FILL_FLOOR if self.cuda else None
        else:
            self.fill_floor = float(fill_floor)
        self._floor = FillFloor(max_batch_tokens)
        self.packing = self.packing_for(packing, self.cuda)
        self.packed = False  # decided in start(): packed forwards where asked for and checked (_pack)
        self.cpu_threads = cpu_threads
        self.warmup = warmup  # None: on CUDA only (see _warm_up)
        self._pending: list[_Request] = []
        self._cv = threading.Condition()
        self._closing = False
        self._worker: threading.Thread | None = None
        self._finisher: threading.Thread | None = None
        self._done: queue.Queue = queue.Queue(maxsize=1)  # batches whose copy is in flight (CUDA)
        self._failure: BaseException | None = None
        self._slabs: PinnedSlabs | None = None  # CUDA: the copies' pinned buffers, made at the first copy
        self._alloc_base: dict = {}  # CUDA: the allocator's counters at the last reset_stats
        self._slab_limit = int(os.environ.get(PINNED_SLABS_ENV, self.PINNED_SLABS))
        self._hooks: list = []  # the engine's own (device clock); the decoder keeps its capture hooks
        # On CUDA, start() puts the Triton kernel here where it matches; fp8 quantizes with torch ops.
        self._stager = stage_fp8 if capture_layout == "fp8" else stage_torch
        self.batches = 0
        self.padded_tokens = 0
        self.real_tokens = 0
        # Where the forward thread's time goes (seconds): a device that waits shows up here, not as an error.
        self.timing = {
            "idle": 0.0,
            "forward": 0.0,
            "stage": 0.0,
            "pin_alloc": 0.0,
            "handoff": 0.0,
            "copy_wait": 0.0,
            "resolve": 0.0,
        }
        # On CUDA, the device's own clock (events, read once a batch's copy is done): its forwards (first
        # layer to final norm), the capture's staging after them, and what lies between one batch's staging
        # and the next forward's first layer: the device waiting on the host, or with no work (idle).
        if device.startswith("cuda"):
            self.timing.update(device_forward=0.0, device_stage=0.0, device_between=0.0, device_layer_excess=0.0)
        # Layers whose start the device had passed before the host began launching the next layer (CUDA).
        self.lead_under_a_layer = 0
        self._forward_log = None  # an open file where HIDDEN_HARVEST_FORWARD_LOG asks for one (CUDA)
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
        self.packed = self._pack()
        checked = staged = time.monotonic()
        if self.cuda:
            # One kernel launch per layer instead of a few hundred small torch ops on the forward thread
            # (actors/hf/staging.py); checked against the torch ops here, and they stay where it does not match.
            if self.capture_layout == "planes":
                self._stager = TritonStager.checked(self.device) or stage_torch
            staged = time.monotonic()
            self._marks: dict = {}
            self._prev_end = None
            self._hooks += [
                layer.register_forward_pre_hook(self._layer_mark(i)) for i, layer in enumerate(self.decoder.layers)
            ]
            self._hooks.append(self.decoder.norm.register_forward_hook(self._mark("norm")))
            log_dir = os.environ.get(FORWARD_LOG_ENV)
            if log_dir:
                path = os.path.join(log_dir, f"forwards-{os.getpid()}-{id(self):x}.jsonl")
                self._forward_log = open(path, "a", buffering=1)  # noqa: SIM115 - closed in close()
                logger.info("hf engine: each forward's shape and device clock go to %s", path)
            self._copy_stream = torch.cuda.Stream()
            self._finisher = threading.Thread(target=self._finish_loop, name="hf-engine-finish", daemon=True)
            self._finisher.start()
        self._worker = threading.Thread(target=self._work_loop, name="hf-engine-forward", daemon=True)
        self._worker.start()
        loaded = time.monotonic()
        if self.cuda if self.warmup is None else self.warmup:
            try:
                self._warm_up()
            except BaseException:
                self.close()
                raise
        self.phases = {
            "load_s": round(loaded - t0, 3),
            # Where the load went (the start-up line prints them): the model's import, read and move to the
            # device (Decoder.load), the packed-against-padded check (_pack) where packing was asked for, and on
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
        """The fill floor in force: engine.fill_floor where it fixes one, else the measured one."""
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

    def _warm_up(self) -> None:
        """One full forward of max_batch_tokens before the engine counts as started.

        The device's kernels load, its memory pool and the pinned staging buffers grow to size, and a
        max_batch_tokens the device cannot hold fails here, at start, instead of splitting every large
        forward of a job (the out-of-memory fallback). SGLang's server warms up before it reports ready in
        the same way, and the benchmarks time warmed engines on both sides. The counters start after it."""
        length = min(self.max_batch_tokens, self.WARMUP_MAX_LENGTH)
        n = max(1, self.max_batch_tokens // length)
        with self._cv:  # queued at once, so the worker takes them as one forward
            futures = [
                self.submit(f"warm-up-{i}", [i % self.vocab_size] * length, order=float("-inf")) for i in range(n)
            ]
        for f in futures:
            res = f.result()
            if res.capture is not None:
                res.capture.release()
            if res.error:
                raise RuntimeError(f"hf engine warm-up ({n} x {length} tokens) failed: {res.error}")
        if self.batches != 1:
            raise RuntimeError(
                f"engine.max_batch_tokens={self.max_batch_tokens} does not fit on {self.device}: a forward of {n} x {length} "
                f"tokens ran out of memory; lower engine.max_batch_tokens"
            )
        if self.cuda and self.packed:
            logger.info(
                "hf engine: packed forwards of %d tokens, the device runs %.1f us a token",
                self.max_batch_tokens,
                1e6 * self.timing["device_forward"] / max(self.padded_tokens, 1),
            )
        elif self.cuda:
            per_token = self.timing["device_forward"] / max(self.padded_tokens, 1)
            launch = self._launch_seconds()
            # Its forwards (the full one, the small ones) were observed as they finished (_device_time).
            logger.info(
                "hf engine: the host launches a forward in %.0f ms, the device runs %.1f us a padded token: "
                "forwards fill to %d tokens before the padding cap applies",
                1000 * launch,
                1e6 * per_token,
                self.min_fill * self.max_batch_tokens,
            )
        self.reset_stats()

    # A packed forward's states differ from a padded one's by kernel rounding (bf16, other matmul shapes,
    # another attention kernel), as a padded row's differ between batches. The check at start allows the
    # larger of this and CHECK_NOISE_FACTOR times what batching alone moves the same sequences; a packed
    # forward that lets sequences see each other is off by ~1 (0.92 on the default model, where packing
    # and batching both move states by 0.02, relative L2 per sequence and kept layer).
    PACKED_TOLERANCE = 0.05
    CHECK_NOISE_FACTOR = 4
    PACK_CHECK_LENGTHS = (37, 1, 100, 64)  # a single token, lengths off any tile

    def _pack(self) -> bool:
        """Whether forwards run packed (engine.packing): where asked for, the model's attention allows it and a
        packed forward of a few sequences gives each the states its padded row gives."""
        if self.packing == "off":
            return False
        refused = self.decoder.pack()  # by the model's config: windows, soft-capping, sinks, MLA
        why = refused or self._check_packing()
        if why is None:
            logger.info("hf engine: packed forwards (no padding)")
            return True
        if self.decoder.attn_implementation == "sdpa":
            self.decoder.base.set_attn_implementation("sdpa")
        if self.packing == "on":
            raise RuntimeError(f"engine.packing=on: {self.model_dir} cannot run packed forwards: {why}")
        # A family known not to pack is what auto (CUDA's default) expects; a failed check is not.
        (logger.info if refused else logger.warning)(
            "hf engine: padded forwards: %s cannot run packed: %s", self.model_dir, why
        )
        return False

    def _kept(self, seqs: list[list[int]], packed: bool = False) -> list[list]:
        """One forward of `seqs` (padded rows: longest first); each sequence's kept states, float, per layer."""
        order = sorted(range(len(seqs)), key=lambda i: -len(seqs[i])) if not packed else list(range(len(seqs)))
        self.decoder.forward([seqs[i] for i in order], keep=True, packed=packed)
        aux, last = self.decoder.outputs()
        layers = [x.float() for x in [*aux, last]]
        starts = _request_starts([len(seqs[i]) for i in order], layers[0].shape[:2], packed)
        flat = [x.reshape(-1, x.shape[-1]) for x in layers]
        out: list[list] = [[] for _ in seqs]
        for pos, i in enumerate(order):
            out[i] = [x[int(starts[pos]) : int(starts[pos]) + len(seqs[i])] for x in flat]
        return out

    def _check_packing(self) -> str | None:
        """None where a packed forward's kept states match the padded forward's for every sequence and layer
        (within PACKED_TOLERANCE or CHECK_NOISE_FACTOR times batching's own noise), else what differed. Runs
        on the caller's thread before the worker starts."""
        import torch

        def distance(a: list, b: list) -> float:
            ds = [float(torch.linalg.vector_norm(x - y) / (torch.linalg.vector_norm(y) + 1e-6)) for x, y in zip(a, b)]
            return max(ds, key=lambda d: np.inf if d != d else d)  # NaN counts as the worst

        gen = np.random.default_rng(0)
        seqs = [gen.integers(0, self.vocab_size, n).tolist() for n in self.PACK_CHECK_LENGTHS]
        try:
            padded = self._kept(seqs)
            noise = max(distance(self._kept([s])[0], want) for s, want in zip(seqs, padded))
        except Exception as e:  # noqa: BLE001 - the padded forward is the engine's own; let start() say so
            self.decoder.discard()
            raise RuntimeError(f"hf engine: a padded forward failed at start: {e}") from e
        try:
            packed = self._kept(seqs, packed=True)
        except Exception as e:  # noqa: BLE001 - anything the packed path cannot run means padded forwards
            self.decoder.discard()
            return f"{type(e).__name__}: {e}"
        diff = max(distance(got, want) for got, want in zip(packed, padded))
        allowed = max(self.PACKED_TOLERANCE, self.CHECK_NOISE_FACTOR * noise)
        if diff <= allowed:
            return None
        return (
            f"a packed forward's states differ from the padded forward's by {diff:.3g} (relative L2), more than "
            f"the {allowed:.3g} allowed (batching alone moves them by {noise:.3g})"
        )

    def _launch_seconds(self, length: int = 256) -> float:
        """The host's time to launch one small forward (the best of two, each alone): on CUDA nothing in a
        forward waits for the device, so this is the Python and launch work every forward costs."""
        took = []
        for i in range(2):
            before = self.timing["forward"]
            res = self.submit(
                f"warm-up-launch-{i}", [i % self.vocab_size] * min(length, self.max_batch_tokens)
            ).result()
            if res.capture is not None:
                res.capture.release()
            if res.error:
                raise RuntimeError(f"hf engine warm-up (one forward of {length} tokens) failed: {res.error}")
            took.append(self.timing["forward"] - before)
        return min(took)

    def reset_stats(self) -> None:
        """Counters from zero (after a warm-up); call with no request in flight."""
        self.batches = self.padded_tokens = self.real_tokens = self.lead_under_a_layer = 0
        self.timing = dict.fromkeys(self.timing, 0.0)
        self.first_forward_unix = self.last_done_unix = None
        self._prev_end = None
        if self._slabs is not None:
            self._slabs.misses = 0
        self._alloc_base = _allocator_counts() if self.cuda else {}
        if self._forward_log is not None:  # readers keep the forwards after the last reset (not the warm-up)
            self._forward_log.write('{"reset": true}\n')

    def stats(self) -> dict:
        """Counters so far: forwards, tokens (real and padded), the forward/finisher threads' seconds and
        the wall clock of the first forward and of the last results."""
        return {
            "forwards": self.batches,
            "real_tokens": self.real_tokens,
            "padded_tokens": self.padded_tokens,
            "packed": self.packed,
            "staging": "triton" if isinstance(self._stager, TritonStager) else f"torch ({self.capture_layout})",
            # How this actor's CPU ran the bf16 products (bf16_gemms.py): the driver's provenance cannot say,
            # since in a cluster the actor's CPU need not be the driver's.
            **({} if self.cuda else {"products": "float32" if self.decoder.float32_gemms else "bfloat16"}),
            **{f"{k}_s": round(v, 3) for k, v in self.timing.items()},
            **({"lead_under_a_layer": self.lead_under_a_layer} if self.cuda else {}),
            "fill_floor_tokens": int(self.min_fill * self.max_batch_tokens),
            **({"fill_floor_launch_ms": round(1000 * median(self._floor.launch_s), 1)} if self._floor.launch_s else {}),
            # Batches that found no free pinned slab and allocated their own (CUDA).
            **({"pinned_slabs": self._slabs.allocated, "pinned_misses": self._slabs.misses} if self._slabs else {}),
            **({"device_allocator": self._allocator_since_reset()} if self.cuda else {}),
            "first_forward_unix": self.first_forward_unix,
            "last_done_unix": self.last_done_unix,
            "start": dict(self.phases),
        }

    def _allocator_since_reset(self) -> dict:
        """The caching allocator's calls into the driver since the last reset. A cudaFree makes the host wait
        for the device to drain, after which the device waits on the host's next launches: a job whose
        forwards free and map device memory loses device time that the warm bare engine does not."""
        now = _allocator_counts()
        return {k: v - self._alloc_base.get(k, 0) for k, v in now.items()}

    def close(self) -> None:
        if self.batches:
            logger.info("hf engine: %s", self.stats())
        with self._cv:
            self._closing = True
            self._cv.notify_all()
        if self._worker is not None:
            self._worker.join(timeout=60)
        if self._finisher is not None:
            self._done.put(None)
            self._finisher.join(timeout=60)
        for h in self._hooks:
            h.remove()
        self._hooks = []
        self.decoder.close()
        self._worker = self._finisher = None
        if self._forward_log is not None:
            self._forward_log.close()
            self._forward_log = None
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

        `order`: requests sharing it form one caller batch; the lowest order is served first (see _take)."""
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
            self._pending.append(_Request(key, list(ids), fut, time.monotonic(), order))
            self._cv.notify()
        return fut

    def capture(self, requests: list[tuple[str, list[int]]]) -> dict[str, RequestResult]:
        """Every request at once; results keyed by the caller's key."""
        futures = [self.submit(key, ids) for key, ids in requests]
        return {r.key: r for r in (f.result() for f in as_completed(futures))}

    # ---- the worker ------------------------------------------------------------------------------

    def _mark(self, name):
        import torch

        def hook(*_args):
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self._marks[name] = event

        return hook

    def _layer_mark(self, i: int):
        """A decoder layer's start on the device clock; layer 0's is the forward's start ("first_layer")."""
        import torch

        def hook(*_args):
            layers = self._marks.setdefault("layers", [])
            if layers and layers[-1].query():
                # The device already runs the previous layer while the host only now launches this one: it
                # has less than a layer of work queued, and any wait of this thread (the interpreter lock,
                # an allocation) becomes device time.
                self._marks["lead_under_a_layer"] = self._marks.get("lead_under_a_layer", 0) + 1
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            layers.append(event)
            if i == 0:
                self._marks["first_layer"] = event

        return hook

    def _take(self, pool: list[_Request]) -> list[_Request]:
        return take_packed(pool, self.max_batch_tokens) if self.packed else take_batch(pool, self.policy)

    def _forward(self, batch: list[_Request]) -> np.ndarray:
        self.batches += 1
        if self.first_forward_unix is None:
            self.first_forward_unix = time.time()
        # Pinned on CUDA: from pageable memory CUDA would first wait for the device to go idle, and the next
        # forward could only be launched once the GPU had run dry.
        ids = self.decoder.forward([r.ids for r in batch], keep=self._keeps, pin=self.cuda, packed=self.packed)
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
                    batch = self._take(self._pending)
                self.timing["idle"] += time.monotonic() - t0
                self._run(batch)
        except BaseException as e:  # noqa: BLE001 - reported through ensure_alive and every waiting future
            self._failure = e
            logger.exception("hf engine worker failed")
            with self._cv:
                for r in self._pending:
                    r.future.set_result(RequestResult(r.key, None, f"engine failed: {e!r}", 0.0))
                self._pending.clear()

    def _run(self, batch: list[_Request]) -> None:
        import torch

        if self.cuda:
            self._marks = {}  # a forward that failed leaves none behind for the next
        try:
            t0, start_unix = time.monotonic(), time.time()
            ids = self._forward(batch)
            t1 = time.monotonic()
            staged = self._stage(batch, ids)
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
        if self.cuda:
            t0 = time.monotonic()
            marks, self._marks = self._marks, {}
            marks.update(host_forward_s=host_forward_s, host_start_unix=start_unix)
            self._done.put((staged, marks))  # blocks while the previous batch's copy is still pending: two in flight
            self.timing["handoff"] += time.monotonic() - t0
        else:
            self._resolve(staged)

    def _stage(self, batch: list[_Request], ids: np.ndarray) -> _Staged:
        """Byte planes [2, W, T] per request (aux, then last) in one buffer, plus the non-finite counts
        per padded position (summed per request on the host over its real positions: a device-side mask
        would need the lengths copied up, a sync point). See actors/hf/staging.py."""
        import torch

        aux, last = self.decoder.outputs()
        h = last.shape[-1]
        lengths = [len(r.ids) for r in batch]
        starts = _request_starts(lengths, ids.shape, self.packed)
        offsets = plane_offsets(lengths, len(aux) + 1, h, self.capture_layout)
        planes = torch.empty(int(offsets[-1]), dtype=torch.uint8, device=last.device)
        bad = torch.zeros(last.shape[:2], dtype=torch.int32, device=last.device)
        self._stager([*aux, last], lengths, starts, offsets, planes, bad)
        del aux, last
        staged = _Staged(batch, ids, starts, planes, offsets, bad, (len(self.aux_layers) * h, h))
        if not self.cuda:
            staged.planes, staged.nonfinite = planes.numpy(), bad.numpy()
        else:
            # The finisher allocates the pinned memory and queues the copy after this event: allocating pinned
            # memory can take a while, and this thread only launches device work. The staging tensors stay
            # referenced (in `staged`) until the finisher has seen the copy end.
            self._mark("end")()
        return staged

    def _copy_to_host(self, staging, bad, end, widths: tuple[int, int], marks: dict | None = None):
        """Queue one batch's device-to-host copy behind its staging (the event `end`): (host, counts, done).
        `marks` gets when the pinned allocation began and how long it took (the forward log's)."""
        import torch

        t0, unix = time.monotonic(), time.time()
        nbytes = staging.numel()
        at = -(-nbytes // 8) * 8  # the counts after the planes, aligned for their int32
        slabs = self._pinned_slabs(widths)
        lent = slabs.take(at + bad.numel() * bad.element_size()) if slabs is not None else None
        if lent is not None:  # one buffer, allocated once: the planes, then the counts
            buffer, array = lent
            host, host_np = buffer[:nbytes], array[:nbytes]
            counts = buffer[at : at + bad.numel() * bad.element_size()].view(bad.dtype).view(bad.shape)
            counts_np = array[at : at + counts.numel() * counts.element_size()].view(np.int32).reshape(bad.shape)
            del buffer
        else:  # larger than a slab, or every slab still lent: allocated for this batch alone
            host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
            counts = torch.empty(bad.shape, dtype=bad.dtype, pin_memory=True)
            host_np, counts_np = host.numpy(), counts.numpy()
        took = time.monotonic() - t0
        self.timing["pin_alloc"] += took
        if marks is not None:
            marks.update(pin_alloc_unix=unix, pin_alloc_s=took)
        with torch.cuda.stream(self._copy_stream):
            self._copy_stream.wait_event(end)
            host.copy_(staging, non_blocking=True)
            counts.copy_(bad, non_blocking=True)
            done = torch.cuda.Event()
            done.record()
        return host_np, counts_np, done

    def _pinned_slabs(self, widths: tuple[int, int]) -> PinnedSlabs | None:
        """The copies' pinned buffers (actors/hf/pinned.py), made at the first copy, which is the warm-up's
        forward of max_batch_tokens: one slab holds the largest batch's planes and counts. Every slab is
        pinned here, at the warm-up, where the time costs no forward."""
        if self._slabs is None and self._slab_limit > 0:
            w, h = widths
            # The body per token (two byte planes per value, or fp8 and a scale per layer), and an int32 count.
            per_token = body_per_token(w // h + 1, h, self.capture_layout) + 4
            self._slabs = PinnedSlabs(self.max_batch_tokens * per_token + 8, self._slab_limit).reserve(self._slab_limit)
        return self._slabs

    def _finish_loop(self) -> None:
        import torch

        torch.cuda.set_device(self._copy_stream.device)  # this thread's pinned allocations and events
        while True:
            item = self._done.get()
            if item is None:
                return
            staged, marks = item
            try:
                done = marks["end"]
                if staged.planes is not None:  # a capture (the benchmark's bare engine stages nothing)
                    host, counts, done = self._copy_to_host(
                        staged.planes, staged.nonfinite, marks["end"], staged.widths, marks
                    )
                t0 = time.monotonic()
                done.synchronize()
                t1 = time.monotonic()
                self.timing["copy_wait"] += t1 - t0
                self._device_time(marks, staged)
                if staged.planes is not None:
                    # Copied: the device memory may go back to the pool.
                    staged.planes, staged.nonfinite = host, counts
                    host = counts = None  # the captures alone hold the pinned memory, which goes back with them
                self._resolve(staged)
                self.timing["resolve"] += time.monotonic() - t1
            except Exception as e:  # noqa: BLE001
                for r in staged.batch:
                    if not r.future.done():
                        r.future.set_result(RequestResult(r.key, None, f"copy failed: {type(e).__name__}: {e}", 0.0))

    def _device_time(self, marks: dict, staged: _Staged | None = None) -> None:
        """Adds one batch's device seconds (its events are complete once its copy is)."""
        first, norm, end = marks.get("first_layer"), marks.get("norm"), marks.get("end")
        if first is None or norm is None or end is None:
            return
        forward_ms = first.elapsed_time(norm)
        excess_ms = layer_excess_ms(marks.get("layers", []), norm)
        between_ms = self._prev_end.elapsed_time(first) if self._prev_end is not None else None
        self.timing["device_forward"] += forward_ms / 1000
        if staged is not None:  # the floor follows what launching a forward costs inside the job
            self._floor.observe(
                marks.get("host_forward_s", 0.0),
                forward_ms / 1000,
                staged.ids.size,
                # Only a forward the device waited for was launched onto an idle device (batching.FillFloor).
                device_waited=between_ms is None or between_ms > self.DEVICE_WAITED_MS,
            )
        self.timing["device_stage"] += norm.elapsed_time(end) / 1000
        self.timing["device_layer_excess"] += excess_ms / 1000
        self.lead_under_a_layer += marks.get("lead_under_a_layer", 0)
        if between_ms is not None:
            self.timing["device_between"] += between_ms / 1000
        self._prev_end = end
        if self._forward_log is not None and staged is not None:
            self._forward_log.write(
                json.dumps(
                    {
                        # Wall clock of the host's launch of this forward and of its batch's pinned
                        # allocation (on the finisher, while a later forward runs): set side by side with
                        # the layer excess they say which host event a forward waited on.
                        "host_start_unix": round(marks.get("host_start_unix", 0.0), 4),
                        "pin_alloc_unix": round(marks.get("pin_alloc_unix", 0.0), 4),
                        "pin_alloc_ms": round(1000 * marks.get("pin_alloc_s", 0.0), 3),
                        "rows": int(staged.ids.shape[0]),
                        "t": int(staged.ids.shape[1]),
                        "lengths": [len(r.ids) for r in staged.batch],
                        "device_ms": round(forward_ms, 3),
                        "layer_excess_ms": round(excess_ms, 3),
                        "between_ms": None if between_ms is None else round(between_ms, 3),
                        "lead_under_a_layer": marks.get("lead_under_a_layer", 0),
                        # Where in the forward the device waited: the layers that ran a millisecond or more
                        # beyond the median, [index, ms over it]. A wait at layer 0 and one deep in the stack
                        # point at different host events (the forward's start, a stall of the launching thread).
                        "slow_layers": slow_layers(marks.get("layers", []), norm),
                        "host_ms": round(1000 * marks.get("host_forward_s", 0.0), 3),
                    }
                )
                + "\n"
            )

    def _resolve(self, staged: _Staged) -> None:
        w, h = staged.widths
        now = time.monotonic()
        self.last_done_unix = time.time()
        starts, ids, nonfinite = staged.starts, staged.ids.reshape(-1), staged.nonfinite.reshape(-1)
        for row, r in enumerate(staged.batch):
            n, a = len(r.ids), int(starts[row])
            header = CaptureHeader(
                rid=r.key,
                num_tokens=n,
                prefix_len=0,
                ids_sha256=_ids_sha256(ids[a : a + n]),
                nonfinite=int(nonfinite[a : a + n].sum()),
                aux_shape=(n, w),
                last_shape=(n, h),
                source_dtype=self.dtype,
                final_layer=self.final_layer,
                layout=self.capture_layout,
            )
            cap = Capture(header, None, 0, body=staged.planes[staged.offsets[row] : staged.offsets[row + 1]])
            r.future.set_result(RequestResult(r.key, cap, None, now - r.submitted, r.key))

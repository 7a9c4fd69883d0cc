"""The hf engine's device clock on CUDA: CUDA events at every decoder layer's start, at the final norm and at
the end of a forward's staging, read once the forward's copy is done.

From them the engine's stats() gets the device's own seconds: its forwards (first layer to final norm), the
staging after them, what lies between one batch's staging and the next forward's first layer (the device
waiting on the host, or with no work), and the layer excess. Every layer of a uniform stack does the same
work, so the time its layers ran beyond the forward's median layer is the device waiting inside the forward
(on the host's kernel launches, a sync, the allocator); a layer whose start the device had already passed
when the host reached the next one says the host was less than a layer ahead (`lead_under_a_layer`).

Beside it, for profiling: the forward log (debug.forward_log: one JSON line per forward with its shape and
clock, for benchmarks to replay) and the caching allocator's counters (stats' `device_allocator`).
"""

from __future__ import annotations

import json
import logging
import os

import numpy as np

logger = logging.getLogger(__name__)


def layer_ms(layers: list, norm) -> list[float]:
    """Each layer's device milliseconds, from the events recorded at every layer's start and at the final norm."""
    return [a.elapsed_time(b) for a, b in zip(layers, [*layers[1:], norm])]


def layer_excess_ms(layers: list, norm) -> float:
    """Device milliseconds a forward's layers ran beyond its median layer's time: time the device spent
    waiting inside the forward (for MoE stacks with dense layers it also holds their real difference)."""
    ms = layer_ms(layers, norm)
    return sum(ms) - len(ms) * float(np.median(ms)) if ms else 0.0


def slow_layers(layers: list, norm, over_ms: float = 1.0) -> list[list]:
    """[index, ms beyond the median layer] of each layer that ran `over_ms` or more beyond it."""
    ms = layer_ms(layers, norm)
    if not ms:
        return []
    mid = float(np.median(ms))
    return [[i, round(t - mid, 2)] for i, t in enumerate(ms) if t - mid >= over_ms]


def allocator_counts() -> dict:
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


class DeviceClock:
    """Marks one forward at a time (the forward thread's), observed later on the finisher's thread.

    `timing` is the engine's dict of seconds, which this adds the device_* entries to."""

    # The keys this clock adds to the engine's timing.
    TIMING = ("device_forward", "device_stage", "device_between", "device_layer_excess")

    def __init__(self, timing: dict, forward_log: str | None = None):
        self.timing = timing
        self.timing.update(dict.fromkeys(self.TIMING, 0.0))
        self.lead_under_a_layer = 0
        self.forward_log = forward_log
        self._log = None  # the open forward log (forward_log set and started)
        self._marks: dict = {}
        self._prev_end = None
        self._hooks: list = []
        self._alloc_base: dict = {}  # the allocator's counters at the last reset

    def start(self, decoder) -> None:
        """Hooks the decoder's layers and final norm; opens the forward log where one is asked for."""
        self._marks, self._prev_end = {}, None
        self._hooks += [layer.register_forward_pre_hook(self._layer_mark(i)) for i, layer in enumerate(decoder.layers)]
        self._hooks.append(decoder.norm.register_forward_hook(lambda *_: self.mark("norm")))
        if self.forward_log:
            path = os.path.join(self.forward_log, f"forwards-{os.getpid()}-{id(self):x}.jsonl")
            self._log = open(path, "a", buffering=1)  # noqa: SIM115 - closed in close()
            logger.info("hf engine: each forward's shape and device clock go to %s", path)

    def close(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks = []
        if self._log is not None:
            self._log.close()
            self._log = None

    def begin(self) -> None:
        """A new forward: a forward that failed leaves no marks behind for the next."""
        self._marks = {}

    def mark(self, name: str) -> None:
        import torch

        event = torch.cuda.Event(enable_timing=True)
        event.record()
        self._marks[name] = event

    def take(self) -> dict:
        """This forward's marks, handed to the finisher with its batch."""
        marks, self._marks = self._marks, {}
        return marks

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

    def observe(self, marks: dict, staged=None) -> tuple[float, float | None] | None:
        """Adds one batch's device seconds (its events are complete once its copy is); returns the forward's
        device milliseconds and those since the previous batch's end (None for the first), or None for a
        batch without its marks (a failed forward)."""
        first, norm, end = marks.get("first_layer"), marks.get("norm"), marks.get("end")
        if first is None or norm is None or end is None:
            return None
        forward_ms = first.elapsed_time(norm)
        excess_ms = layer_excess_ms(marks.get("layers", []), norm)
        between_ms = self._prev_end.elapsed_time(first) if self._prev_end is not None else None
        self.timing["device_forward"] += forward_ms / 1000
        self.timing["device_stage"] += norm.elapsed_time(end) / 1000
        self.timing["device_layer_excess"] += excess_ms / 1000
        self.lead_under_a_layer += marks.get("lead_under_a_layer", 0)
        if between_ms is not None:
            self.timing["device_between"] += between_ms / 1000
        self._prev_end = end
        if self._log is not None and staged is not None:
            self._log.write(json.dumps(_log_line(marks, staged, forward_ms, excess_ms, between_ms, norm)) + "\n")
        return forward_ms, between_ms

    def reset(self) -> None:
        """Counters from zero; the forward log marks where the counted forwards begin."""
        self.lead_under_a_layer = 0
        self._prev_end = None
        self._alloc_base = allocator_counts()
        if self._log is not None:  # readers keep the forwards after the last reset (not the warm-up)
            self._log.write('{"reset": true}\n')

    def allocator_since_reset(self) -> dict:
        """The caching allocator's calls into the driver since the last reset. A cudaFree makes the host wait
        for the device to drain, after which the device waits on the host's next launches: a job whose
        forwards free and map device memory loses device time that a warm engine does not."""
        now = allocator_counts()
        return {k: v - self._alloc_base.get(k, 0) for k, v in now.items()}


def _log_line(marks: dict, staged, forward_ms: float, excess_ms: float, between_ms: float | None, norm) -> dict:
    return {
        # Wall clock of the host's launch of this forward and of its batch's pinned allocation (on the
        # finisher, while a later forward runs): set side by side with the layer excess they say which host
        # event a forward waited on.
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
        # Where in the forward the device waited: the layers that ran a millisecond or more beyond the median,
        # [index, ms over it]. A wait at layer 0 and one deep in the stack point at different host events (the
        # forward's start, a stall of the launching thread).
        "slow_layers": slow_layers(marks.get("layers", []), norm),
        "host_ms": round(1000 * marks.get("host_forward_s", 0.0), 3),
    }

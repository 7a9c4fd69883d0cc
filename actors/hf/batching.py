"""Which waiting requests the hf engine's next forward takes: a pure function of the pool and a policy.

It runs on the engine's forward thread between forwards, and in bench/probes/sim_take.py without a model.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from statistics import median
from typing import Protocol, TypeVar


class Waiting(Protocol):
    ids: Sequence[int]
    order: float  # the caller batch's age: lower is older


R = TypeVar("R", bound=Waiting)


@dataclass(frozen=True)
class BatchPolicy:
    max_batch_tokens: int
    # Most padded tokens a forward may carry, as a share of its real ones.
    max_padding: float = 0.03
    # Below this share of max_batch_tokens a forward fills whatever the padding. On CUDA the engine sets it
    # from its warm-up (fill_share): below it a forward is done before the host has launched it.
    min_fill: float = 0.125


def fill_share(host_launch_s: float, device_s_per_token: float, max_batch_tokens: int) -> float:
    """The fill floor as a share of max_batch_tokens: the forward size whose device time equals the host's
    time to launch a forward, within [1/8, 1/2].

    The host needs about the same time to launch a forward of any size (every layer's kernels, from Python:
    bench/results/forward_host_h200.json), while the device's time grows with the tokens. A smaller forward
    leaves the device waiting on the host, so up to this size padding is free: the device would have waited
    anyway. Half the budget at most, so that a slow host does not turn every forward into padding; an eighth
    at least, the unmeasured floor."""
    if host_launch_s <= 0 or device_s_per_token <= 0 or max_batch_tokens <= 0:
        return BatchPolicy.min_fill
    return min(0.5, max(0.125, host_launch_s / device_s_per_token / max_batch_tokens))


class FillFloor:
    """The fill floor (`fill_share`), kept up to date from the engine's own forwards while a job runs.

    A forward tells the launch cost only if the device had run dry before it (`device_waited`): otherwise
    the host's time includes waiting for earlier forwards. CUDA lets the host queue only so many launches;
    past that, each launch blocks until the device has run earlier work, so a small forward queued behind a
    large one "took" most of that one's device time to launch. Counted, they would put the launch several
    times above a launch onto an idle device and the floor at its cap, padding every forward under half the
    budget for nothing (bench/results/forward_host_h200.json, benchmix_floor_launch_fix_h200.json). Counted: a
    forward whose device time was shorter than the host's launch of it onto an idle device (host-bound, so its
    host time is what a launch costs, contention in the job's process included); and, for the device's time
    per padded token, one of at least half the budget. The medians of the last `window` of each set the
    floor."""

    def __init__(self, max_batch_tokens: int, window: int = 32):
        self.max_batch_tokens = max_batch_tokens
        self.launch_s: deque[float] = deque(maxlen=window)
        self.token_s: deque[float] = deque(maxlen=window)
        self.share = BatchPolicy.min_fill

    def observe(self, host_s: float, device_s: float, padded_tokens: int, device_waited: bool = True) -> float:
        """One forward: the host's time to launch it, the device's time to run it, whether the device sat idle
        before it (its launch queued behind nothing); returns the floor (share)."""
        if device_waited and 0 < device_s < host_s:
            self.launch_s.append(host_s)
        if padded_tokens >= self.max_batch_tokens // 2 and device_s > 0:
            self.token_s.append(device_s / padded_tokens)
        if self.launch_s and self.token_s:
            self.share = fill_share(median(self.launch_s), median(self.token_s), self.max_batch_tokens)
        return self.share


def take_batch(pool: list[R], policy: BatchPolicy) -> list[R]:
    """Next forward: the longest request of the oldest caller batch sets the padded length T; the rest are the
    longest waiting requests of at most T tokens (any batch), up to max_batch_tokens padded, stopping early
    where padding would pass `max_padding` of the real tokens once the forward holds `min_fill` of the budget.

    The oldest batch goes first so that caller batches keep completing while later ones run: while one is
    encoded and committed, the requests of the others keep the device busy. Plain longest-first would leave
    every caller batch's shortest requests to the end, all batches would finish together and the device would
    idle through their commits. The padding cap keeps forwards from carrying short requests padded to a long
    one; below the fill floor a forward takes whatever is left. The settings and what they cost are measured
    in bench/results/take_simulation.json and job_h200.json.

    The taken requests leave `pool` (in place); the first of the result is the longest."""
    oldest = min(r.order for r in pool)
    head = max((r for r in pool if r.order == oldest), key=lambda r: len(r.ids))
    longest = len(head.ids)
    room = max(1, policy.max_batch_tokens // max(longest, 1)) - 1
    rest = sorted((r for r in pool if r is not head and len(r.ids) <= longest), key=lambda r: (-len(r.ids), r.order))
    batch, real = [head], longest
    for r in rest[:room]:
        n = len(r.ids)
        over_padded = longest * (len(batch) + 1) > (real + n) * (1 + policy.max_padding)
        if over_padded and longest * len(batch) >= policy.max_batch_tokens * policy.min_fill:
            break
        batch.append(r)
        real += n
    taken = {id(r) for r in batch}
    pool[:] = [r for r in pool if id(r) not in taken]
    return batch


def take_packed(pool: list[R], max_batch_tokens: int) -> list[R]:
    """Next packed forward (no padding): the oldest caller batch's requests longest first, then the next
    batch's, each taken where it still fits in max_batch_tokens, so a forward is the oldest work that fills it
    (first-fit decreasing within a batch: the short ones fill what the long ones leave). A request longer than
    the budget runs alone. The taken requests leave `pool` (in place)."""
    batch: list[R] = []
    room = max_batch_tokens
    for r in sorted(pool, key=lambda r: (r.order, -len(r.ids))):
        n = len(r.ids)
        if n <= room or not batch:
            batch.append(r)
            room -= n
            if room <= 0:
                break
    taken = {id(r) for r in batch}
    pool[:] = [r for r in pool if id(r) not in taken]
    return batch

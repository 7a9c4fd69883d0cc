"""Equal within bf16 noise: one rule for the audit and for every test that compares hidden states.

A bf16 forward is not a float32 forward with rounding on top: rounding at every layer compounds, and on
some tokens (early positions of random prompts, tokens where attention is nearly tied) any bf16 forward
lands far from float32 (bench/results/noise_rule.json, audit_8b_h200.json). A fixed cosine threshold is therefore either too loose to catch damage or crossed now and then
by healthy data. This module judges a stored layer by the yardstick the model itself sets: the distance
from the float32 truth of bf16 forwards of the same tokens (the reference in bf16, once with each of two
attention kernels).

Distances are relative L2 per token, |got - ref| / |ref|; unlike cosine it also sees a layer stored at
the wrong scale. A stored layer passes when

  * its mean over the sample's tokens is within SAMPLE_FACTOR times the yardsticks' mean, and
  * every token is within TOKEN_FACTOR times the largest of the yardsticks' distances at that token (in
    this layer and, when the sample's shallower layers are judged with it, in those), and their mean over
    the sample, and
  * every token's largest single-element deviation (max |got - ref| over the hidden dimension, over |ref|)
    is within PEAK_FACTOR times the yardsticks' largest at that token (or their mean over the sample),
    widened by as much as the shallower layers widen the token's distance,

each plus FLOOR, one bf16 unit roundoff (what storing a float32 value as bf16 costs on its own, so a
float32 server stored as bf16 passes however exact the yardsticks happen to be).

Why each criterion, in a sentence each (the measurements and the margins they leave are in
bench/reports/audit-noise-rule_cpu-h200_2026-12-07.md, from bench/results/noise_rule.json and
audit_8b_h200.json):
  * the largest element: a relative L2 distance spreads one bad value over the whole hidden dimension, so a
    single flipped value on a large model hides within the distance's noise; bf16 noise is spread over every
    element, a corrupted value is not;
  * two yardsticks: how far one bf16 forward strays at a sensitive token is itself random, and the larger of
    two independent ones bounds another forward's stray far better than one;
  * shallower layers: drift a token picks up in one layer rides the residual stream upwards while a later
    layer may pull the yardsticks back near float32; noise cannot flow downwards, so a token's allowance takes
    the largest yardstick distance at that token over this layer and the shallower ones (`judge_layers`);
  * routing: in a mixture-of-experts layer a near tie between the k-th and the (k+1)-th router score can send
    a bf16 token to another expert, a jump rather than drift. A choice is a near tie when the float32 margin
    is at most ROUTE_FACTOR times how far the yardsticks' scores stray there; the float32 reference runs the
    layer again with the token's last chosen expert swapped for the runner-up (actors/hf/decoder.py), and from
    that layer up the token's allowances grow by FLIP_FACTOR times that change, over the token's norm
    (`NearTies`). A yardstick whose own routing flipped at a token (its top-k set differs from float32's)
    is left out of that token's yardstick distance from then on, since the flip is allowed for apart; where
    every yardstick flipped, the sample's mean distance stands for the drift. The allowance grows by what a
    flip can do and no more, so a corrupted value at a near-tie token still fails; sample means are
    unchanged, so damage spread over a sample fails as before.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

SAMPLE_FACTOR = 3.5
TOKEN_FACTOR = 8.0
PEAK_FACTOR = 12.0
FLOOR = 2.0**-8
ROUTE_FACTOR = 4.0
FLIP_FACTOR = 2.0
FINAL_DEPTH = float("inf")  # the final state's place among layer ids, for `depths` below


def as_float(x) -> np.ndarray:
    """float64 [T, H] from bf16 bits (uint16, as the codec decodes them), a numpy array or a torch tensor."""
    if hasattr(x, "detach"):  # torch, any dtype (bf16 has no numpy equivalent)
        x = x.detach().float().cpu().numpy()
    x = np.asarray(x)
    if x.dtype == np.uint16:
        x = (x.astype(np.uint32) << 16).view(np.float32)
    return x.astype(np.float64)


def _over_ref_norm(diff: np.ndarray, ref: np.ndarray) -> np.ndarray:
    """Per-token `diff` [T] over |ref| per token; inf where diff is not finite or ref is zero and diff not."""
    scale = np.linalg.norm(ref, axis=-1)
    with np.errstate(invalid="ignore", divide="ignore"):
        out = np.where(scale > 0, diff / scale, np.where(diff > 0, np.inf, 0.0))
    return np.nan_to_num(out, nan=np.inf)


def token_errors(got, ref) -> np.ndarray:
    """Per-token relative L2 distance |got - ref| / |ref| (float64 [T]); inf where got is not finite."""
    a, b = as_float(got), as_float(ref)
    return _over_ref_norm(np.linalg.norm(a - b, axis=-1), b)


def peak_errors(got, ref) -> np.ndarray:
    """Per token the largest single-element deviation over the token's norm, max |got - ref| / |ref| ([T]);
    inf where got is not finite."""
    a, b = as_float(got), as_float(ref)
    return _over_ref_norm(np.abs(a - b).max(axis=-1) if a.shape[-1] else np.zeros(a.shape[0]), b)


def _largest_unflipped(values: list, flipped=None) -> np.ndarray:
    """Per token the largest of the yardsticks' values ([Y] x [T]), leaving out at each token the yardsticks
    whose MoE routing flipped there (`flipped`: [T] bool per yardstick; a flip is allowed for apart, by what
    it measurably moves the token, so its distance is not drift); 0 where all flipped, so that the sample's
    mean stands for the drift there."""
    v = np.asarray(values, dtype=np.float64)
    if flipped is None:
        return v.max(axis=0)
    f = np.asarray(flipped, dtype=bool)
    kept = np.where(f, -np.inf, v).max(axis=0)
    return np.where(f.all(axis=0), 0.0, kept)


def yardstick_distances(yardsticks, ref, flipped=None) -> tuple[np.ndarray, float]:
    """(per token the largest yardstick distance, the yardsticks' mean distance) to `ref`; `flipped` as in
    `_largest_unflipped`."""
    ys = yardsticks if isinstance(yardsticks, (list, tuple)) else [yardsticks]
    dists = [token_errors(y, ref) for y in ys]
    mean = float(np.mean([d.mean() for d in dists]) if dists[0].size else 0.0)
    return _largest_unflipped(dists, flipped), mean


def upstream_noise(refs, yardsticks, depths=None, near_ties=None) -> list[np.ndarray | None]:
    """Per layer of one sample, the largest yardstick distance at each token over its strictly shallower
    layers (None for the shallowest). `refs` and `yardsticks` are per layer; `depths` orders them (layer
    ids; the final state deepest), by default the order given; `near_ties`: per layer, its NearTies or None
    (a yardstick's distance where its routing flipped is left out). Layers must cover the same tokens."""
    depths = list(range(len(refs))) if depths is None else list(depths)
    near_ties = near_ties or [None] * len(refs)
    own = [
        yardstick_distances(y, as_float(r), t.flipped if t is not None else None)[0]
        for r, y, t in zip(refs, yardsticks, near_ties)
    ]
    out: list[np.ndarray | None] = [None] * len(refs)
    running = None
    for j in sorted(range(len(refs)), key=lambda j: depths[j]):
        out[j] = running
        running = own[j] if running is None else np.maximum(running, own[j])
    return out


def near_tie_routes(truth, yardsticks, top_k: int, factor: float = ROUTE_FACTOR) -> np.ndarray:
    """[T] bool: the tokens whose top-k expert choice at one router is a near tie that bf16 may flip. `truth`: the float32
    forward's router scores [T, E]; `yardsticks`: the bf16 forwards' (one array or several)."""
    t = as_float(truth)
    if t.shape[0] == 0 or t.shape[-1] <= top_k:
        return np.zeros(t.shape[0], dtype=bool)
    ordered = -np.sort(-t, axis=-1)
    margin = ordered[:, top_k - 1] - ordered[:, top_k]
    ys = yardsticks if isinstance(yardsticks, (list, tuple)) else [yardsticks]
    stray = np.max([np.abs(as_float(y) - t).max(axis=-1) for y in ys], axis=0)
    return margin <= factor * np.maximum(stray, stray.mean())


@dataclass(frozen=True)
class NearTies:
    """The tokens of one stored layer whose routing was a near tie at a MoE layer at or below it, and how far
    flips there may move each (over those MoE layers, root of the sum of squares; absolute: the L2 norm and
    the largest element of the expert output's change)."""

    tokens: np.ndarray  # [T] bool
    move: np.ndarray  # [T]
    peak: np.ndarray  # [T]
    flipped: tuple | None = None  # per yardstick, [T] bool: its routing differs from float32's there

    def take(self, keep) -> NearTies:
        flipped = None if self.flipped is None else tuple(f[keep] for f in self.flipped)
        return NearTies(self.tokens[keep], self.move[keep], self.peak[keep], flipped)


def near_tie_tokens(ties: dict, depth: float) -> NearTies | None:
    """For a layer at `depth` (its layer id; FINAL_DEPTH for the final state): the tokens at a near tie at
    some MoE layer at or below it (aux layer i is decoder layer i's output, so its own router counts), or
    None. `ties`: MoE layer -> (`near_tie_routes` [T] bool, flip L2 norm [T], flip largest element [T],
    and optionally per yardstick [T] bool where its top-k choice differs from float32's)."""
    below = [t for layer, t in ties.items() if layer <= depth]
    if not below or not any(t[0].any() for t in below):
        return None
    tokens = np.logical_or.reduce([t[0] for t in below])
    # Flips at several layers add as independent changes do: root of the sum of squares (checked on the
    # DeepSeek-V3 family model, bench/reports/audit-noise-rule_cpu-h200_2026-12-07.md).
    move = np.sqrt(np.sum([np.where(t[0], np.asarray(t[1], np.float64), 0.0) ** 2 for t in below], axis=0))
    peak = np.sqrt(np.sum([np.where(t[0], np.asarray(t[2], np.float64), 0.0) ** 2 for t in below], axis=0))
    flipped = None
    if all(len(t) > 3 for t in below):
        flipped = tuple(np.logical_or.reduce(per_y) for per_y in zip(*(t[3] for t in below)))
    return NearTies(tokens, move, peak, flipped)


def flipped_routes(truth, yardsticks, top_k: int) -> tuple:
    """Per yardstick, [T] bool: where its top-k expert set differs from the float32 forward's."""
    t = as_float(truth)
    want = np.sort(np.argsort(-t, axis=-1)[:, :top_k], axis=-1)
    ys = yardsticks if isinstance(yardsticks, (list, tuple)) else [yardsticks]
    return tuple((np.sort(np.argsort(-as_float(y), axis=-1)[:, :top_k], axis=-1) != want).any(axis=-1) for y in ys)


def peak_base(yardsticks, ref, own, widened, flipped=None) -> np.ndarray:
    """Per token, what the largest-element criterion multiplies by PEAK_FACTOR: the yardsticks' largest
    element deviation there (or its mean over the sample, where larger), widened by widened / own, the
    ratio by which drift from shallower layers widened the token's distance allowance."""
    ys = yardsticks if isinstance(yardsticks, (list, tuple)) else [yardsticks]
    ypeak = _largest_unflipped([peak_errors(y, ref) for y in ys], flipped)
    with np.errstate(invalid="ignore", divide="ignore"):
        widen = np.maximum(1.0, np.nan_to_num(widened / own, nan=1.0, posinf=1.0))
    return np.maximum(ypeak, ypeak.mean()) * widen


def ratios(got, ref, yardsticks, upstream=None) -> tuple[float, float, float]:
    """(sample mean distance / the yardsticks' mean, the worst token's distance / its allowance's base, the
    worst token's largest element / its base): the three numbers the factors bound, without the floor. For
    measuring the rule's margins."""
    err = token_errors(got, ref)
    if err.size == 0:
        return 0.0, 0.0, 0.0
    b = as_float(ref)
    noise, mean = yardstick_distances(yardsticks, b)
    own = np.maximum(noise, mean)
    if upstream is not None:
        noise = np.maximum(noise, upstream)
    widened = np.maximum(noise, mean)
    base = np.maximum(widened, FLOOR)
    pbase = np.maximum(peak_base(yardsticks, b, own, widened), FLOOR)
    return float(err.mean() / max(mean, FLOOR)), float((err / base).max()), float((peak_errors(got, b) / pbase).max())


@dataclass(frozen=True)
class NoiseRule:
    sample_factor: float = SAMPLE_FACTOR
    token_factor: float = TOKEN_FACTOR
    floor: float = FLOOR
    peak_factor: float = PEAK_FACTOR
    flip_factor: float = FLIP_FACTOR

    def judge(self, got, ref, yardsticks, upstream=None, near_ties=None, quantized=None) -> Deviation:
        """How far `got` is from the float32 truth `ref`, against how far bf16 forwards of the same tokens
        (`yardsticks`: one array or several) are; `upstream`: per token, their largest distance in the
        sample's shallower layers (`upstream_noise`), which widens that token's allowance; `near_ties`: the
        tokens whose MoE routing was a near tie (`near_tie_tokens`), allowed what a flip there can move them;
        `quantized`: for a lossy (fp8) output, per stored value the most its quantization can have moved it
        ([T, H], `pipeline.format.codec.fp8_error_bound`): every allowance grows by exactly that at each token."""
        a, b = as_float(got), as_float(ref)
        if a.shape != b.shape:
            return Deviation(int(b.shape[0]) if b.ndim else 0, np.inf, 0.0, 0, np.inf, 0.0, np.inf, False)
        err = token_errors(a, b)
        if err.size == 0:
            return Deviation(0, 0.0, 0.0, 0, 0.0, self.floor, self.floor, True)
        flipped = near_ties.flipped if near_ties is not None else None
        noise, noise_mean = yardstick_distances(yardsticks, b, flipped)
        own = np.maximum(noise, noise_mean)
        if upstream is not None:
            if len(upstream) != len(noise):
                raise ValueError(f"upstream noise covers {len(upstream)} tokens, the layer {len(noise)}")
            noise = np.maximum(noise, upstream)
        allowed = self.token_factor * np.maximum(noise, noise_mean) + self.floor
        # The largest element, against the yardsticks' largest: drift carried up from shallower layers widens
        # it as it widens the distance (by the same ratio), since nothing says where in the vector it lands.
        peak = peak_errors(a, b)
        peak_allowed = (
            self.peak_factor * peak_base(yardsticks, b, own, np.maximum(noise, noise_mean), flipped) + self.floor
        )
        ties = 0
        if near_ties is not None:
            if len(near_ties.tokens) != len(err):
                raise ValueError(f"near ties cover {len(near_ties.tokens)} tokens, the layer {len(err)}")
            ties = int(near_ties.tokens.sum())
            scale = np.linalg.norm(b, axis=-1)
            with np.errstate(invalid="ignore", divide="ignore"):
                move = np.nan_to_num(near_ties.move / scale, nan=0.0, posinf=0.0)
                peak_move = np.nan_to_num(near_ties.peak / scale, nan=0.0, posinf=0.0)
            allowed = allowed + np.where(near_ties.tokens, self.flip_factor * move, 0.0)
            peak_allowed = peak_allowed + np.where(near_ties.tokens, self.flip_factor * peak_move, 0.0)
        quant_mean = 0.0
        if quantized is not None:
            # Quantization error adds to the bf16 forward's (triangle inequality): the bound at each token,
            # over its norm, on top of the bf16 allowance. A swapped or shifted sample stands ~1.4 off, far past.
            q = np.asarray(quantized, dtype=np.float64)
            if q.shape != a.shape:
                raise ValueError(f"quantization bounds {q.shape} do not match the layer {a.shape}")
            q_l2 = _over_ref_norm(np.linalg.norm(q, axis=-1), b)
            q_peak = _over_ref_norm(q.max(axis=-1) if q.shape[-1] else np.zeros(q.shape[0]), b)
            allowed, peak_allowed = allowed + q_l2, peak_allowed + q_peak
            quant_mean = float(q_l2.mean())
        worst = int(np.argmax(err / allowed))
        worst_peak = int(np.argmax(peak / peak_allowed))
        sample_allowed = self.sample_factor * noise_mean + self.floor + quant_mean
        mean = float(err.mean())
        passed = mean <= sample_allowed and bool((err <= allowed).all()) and bool((peak <= peak_allowed).all())
        return Deviation(
            int(err.size),
            mean,
            noise_mean,
            worst,
            float(err[worst]),
            float(allowed[worst]),
            sample_allowed,
            passed,
            ties,
            worst_peak,
            float(peak[worst_peak]),
            float(peak_allowed[worst_peak]),
        )

    def judge_layers(self, gots, refs, yardsticks, depths=None, near_ties=None) -> list[Deviation]:
        """Every stored layer of one sample (same tokens each), each token allowed the noise it carries up
        from the shallower layers; `depths` as in `upstream_noise`; `near_ties` as in `near_tie_tokens`."""
        depths = list(range(len(refs))) if depths is None else list(depths)
        ex = [near_tie_tokens(near_ties or {}, d) for d in depths]
        ups = upstream_noise(refs, yardsticks, depths, ex)
        return [self.judge(g, r, y, u, e) for g, r, y, u, e in zip(gots, refs, yardsticks, ups, ex)]

    def describe(self) -> str:
        return (
            f"relative L2 distance to float32 per token: sample mean <= {self.sample_factor} x bf16 forwards' + "
            f"{self.floor:.4g}, each token <= {self.token_factor} x max(their distances there and in shallower layers, that mean) + {self.floor:.4g}, "
            f"and its largest element's deviation <= {self.peak_factor} x theirs (widened alike) + {self.floor:.4g}; "
            f"a token whose MoE routing margin is <= {ROUTE_FACTOR} x the bf16 forwards' router error is allowed "
            f"{self.flip_factor} x what swapping its last expert moves it, from that layer up"
        )


@dataclass(frozen=True)
class Deviation:
    """One stored layer of one sample against the float32 truth, and the bf16 yardstick of the same tokens."""

    tokens: int
    mean_error: float  # mean relative L2 distance over the sample's tokens
    noise_error: float  # the same for the bf16 yardstick
    worst_token: int  # the token furthest past its own allowance
    worst_error: float
    worst_allowed: float
    sample_allowed: float
    passed: bool
    near_ties: int = 0  # tokens allowed what a routing flip moves them: their MoE routing was a near tie
    peak_token: int = 0  # the token whose largest element is furthest past its allowance
    peak_error: float = 0.0  # that element's deviation over the token's norm
    peak_allowed: float = 0.0

    @property
    def sample_ratio(self) -> float:
        """Mean distance in units of the yardstick's (1.0: as far from float32 as a bf16 forward is)."""
        return self.mean_error / max(self.noise_error, FLOOR)

    def why(self) -> str:
        if self.passed:
            return "within bf16 noise"
        if self.mean_error > self.sample_allowed:
            return (
                f"mean distance {self.mean_error:.4g} > allowed {self.sample_allowed:.4g} "
                f"(bf16 forward: {self.noise_error:.4g})"
            )
        if self.worst_error > self.worst_allowed:
            return f"token {self.worst_token}: distance {self.worst_error:.4g} > allowed {self.worst_allowed:.4g}"
        return (
            f"token {self.peak_token}: its largest element off by {self.peak_error:.4g} of the token's norm "
            f"> allowed {self.peak_allowed:.4g}"
        )


DEFAULT_RULE = NoiseRule()

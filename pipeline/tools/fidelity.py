"""Equal within bf16 noise: one rule for the audit and for every test that compares hidden states.

A bf16 forward is not a float32 forward with rounding on top: rounding at every layer compounds, and on
some tokens (early positions of random prompts, tokens where attention is nearly tied) any bf16 forward
lands far from float32 (per-token cosine 0.99 and below on the default model, ~0.9975 mean at the last of
36 layers). A fixed cosine threshold is therefore either too loose to catch damage or crossed now and then
by healthy data. This module judges a stored layer by the yardstick the model itself sets: the distance of
a bf16 forward of the same tokens (the reference engine in bf16) from the float32 truth.

Distances are relative L2 per token, |got - ref| / |ref|; unlike cosine it also sees a layer stored at
the wrong scale. A stored layer passes when

  * its mean over the sample's tokens is within SAMPLE_FACTOR times the yardstick's mean, and
  * every token is within TOKEN_FACTOR times the larger of the yardstick at that token and the
    yardstick's mean over the sample (a token that is sensitive for one bf16 forward is sensitive for all),

each plus FLOOR, one bf16 unit roundoff (what storing a float32 value as bf16 costs on its own, so a
float32 server stored as bf16 passes however exact the yardstick happens to be).

The factors come from measurements (bench/results/noise_rule.json): on healthy outputs of both engines the
worst sample stood at 1.6x its yardstick's mean and the worst token at 3.0x its allowance's base; damage
(another sample's states, the neighbouring layer, the sequence offset by one token, one value corrupted)
stands at 6x to several hundred x. The factors leave a margin of 2x or more on both sides.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

SAMPLE_FACTOR = 3.5
TOKEN_FACTOR = 6.0
FLOOR = 2.0**-8


def as_float(x) -> np.ndarray:
    """float64 [T, H] from bf16 bits (uint16, as the codec decodes them), a numpy array or a torch tensor."""
    if hasattr(x, "detach"):  # torch, any dtype (bf16 has no numpy equivalent)
        x = x.detach().float().cpu().numpy()
    x = np.asarray(x)
    if x.dtype == np.uint16:
        x = (x.astype(np.uint32) << 16).view(np.float32)
    return x.astype(np.float64)


def token_errors(got, ref) -> np.ndarray:
    """Per-token relative L2 distance |got - ref| / |ref| (float64 [T]); inf where got is not finite."""
    a, b = as_float(got), as_float(ref)
    diff = np.linalg.norm(a - b, axis=-1)
    scale = np.linalg.norm(b, axis=-1)
    with np.errstate(invalid="ignore", divide="ignore"):
        err = np.where(scale > 0, diff / scale, np.where(diff > 0, np.inf, 0.0))
    return np.nan_to_num(err, nan=np.inf)


def ratios(got, ref, yardstick) -> tuple[float, float]:
    """(sample mean distance / the yardstick's mean, the worst token's distance / its allowance's base): the
    two numbers the factors bound, without the floor. For measuring the rule's margins."""
    err, noise = token_errors(got, ref), token_errors(yardstick, ref)
    if err.size == 0:
        return 0.0, 0.0
    base = np.maximum(np.maximum(noise, noise.mean()), FLOOR)
    return float(err.mean() / max(noise.mean(), FLOOR)), float((err / base).max())


@dataclass(frozen=True)
class NoiseRule:
    sample_factor: float = SAMPLE_FACTOR
    token_factor: float = TOKEN_FACTOR
    floor: float = FLOOR

    def judge(self, got, ref, yardstick) -> Deviation:
        """How far `got` is from the float32 truth `ref`, against how far a bf16 forward (`yardstick`) is."""
        if as_float(got).shape != as_float(ref).shape:
            n = int(as_float(ref).shape[0]) if as_float(ref).ndim else 0
            return Deviation(n, np.inf, 0.0, 0, np.inf, 0.0, np.inf, False)
        err, noise = token_errors(got, ref), token_errors(yardstick, ref)
        if err.size == 0:
            return Deviation(0, 0.0, 0.0, 0, 0.0, self.floor, self.floor, True)
        noise_mean = float(noise.mean())
        allowed = self.token_factor * np.maximum(noise, noise_mean) + self.floor
        worst = int(np.argmax(err / allowed))
        sample_allowed = self.sample_factor * noise_mean + self.floor
        mean = float(err.mean())
        passed = mean <= sample_allowed and bool((err <= allowed).all())
        return Deviation(
            int(err.size), mean, noise_mean, worst, float(err[worst]), float(allowed[worst]), sample_allowed, passed
        )

    def describe(self) -> str:
        return (
            f"relative L2 distance to float32 per token: sample mean <= {self.sample_factor} x a bf16 forward's + "
            f"{self.floor:.4g}, each token <= {self.token_factor} x max(its bf16 distance, that mean) + {self.floor:.4g}"
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
        return f"token {self.worst_token}: distance {self.worst_error:.4g} > allowed {self.worst_allowed:.4g}"


DEFAULT_RULE = NoiseRule()

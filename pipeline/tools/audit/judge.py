"""The audit's verdicts: each stored layer of a sample judged against the reference by the bf16-noise rule
(pipeline/tools/fidelity.py), and the report that gathers them (per layer, the worst, as text and JSON)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np

from pipeline.tools.audit.reference import REFERENCE_RUNS
from pipeline.tools.fidelity import (
    DEFAULT_RULE,
    FINAL_DEPTH,
    FLOOR,
    Deviation,
    NoiseRule,
    as_float,
    near_tie_tokens,
    upstream_noise,
)


@dataclass
class LayerResult:
    """One stored layer of one sample: the noise rule's verdict, and cosines for the reader."""

    sample_id: str
    layer: str  # "aux layer 2", ..., "final"
    tokens: int
    mean_cosine: float
    min_cosine: float
    max_abs_diff: float
    mean_error: float  # relative L2 distance to float32, mean over tokens
    noise_error: float  # the same for a bf16 forward of the same tokens (the yardstick)
    worst_token: int  # the token furthest past its allowance
    worst_error: float
    worst_allowed: float
    sample_allowed: float
    passed: bool
    near_ties: int = 0  # tokens at a MoE routing near tie, allowed more (pipeline/tools/fidelity.py)
    peak_token: int = 0  # the token whose largest element is furthest past its allowance
    peak_error: float = 0.0
    peak_allowed: float = 0.0

    @property
    def ratio(self) -> float:
        """How many times a bf16 forward's distance this layer stands from float32 (its mean over tokens)."""
        return self.mean_error / max(self.noise_error, FLOOR)

    @property
    def excess(self) -> float:
        """How many times its allowance the sample stands, by the criterion it is furthest on (> 1: failed)."""
        parts = [(self.mean_error, self.sample_allowed), (self.worst_error, self.worst_allowed)]
        parts.append((self.peak_error, self.peak_allowed))
        return max(e / a if a > 0 else (float("inf") if e > 0 else 0.0) for e, a in parts)

    def why(self) -> str:
        return Deviation(
            self.tokens,
            self.mean_error,
            self.noise_error,
            self.worst_token,
            self.worst_error,
            self.worst_allowed,
            self.sample_allowed,
            self.passed,
            self.near_ties,
            self.peak_token,
            self.peak_error,
            self.peak_allowed,
        ).why()


@dataclass
class AuditReport:
    output: str
    model: str
    device: str
    rule: NoiseRule
    final_layer: str = "post_norm"  # the stored convention the final layer was judged under
    samples: list[str] = field(default_factory=list)
    results: list[LayerResult] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def failures(self) -> list[LayerResult]:
        return [r for r in self.results if not r.passed]

    @property
    def ok(self) -> bool:
        return bool(self.results) and not self.failures

    def worst(self) -> LayerResult | None:
        """The failure (or, with none, the result) furthest past its allowance, sample mean or worst token."""
        if not self.results:
            return None
        return max(
            self.failures or self.results,
            key=lambda r: r.excess,
        )

    def per_layer(self) -> dict[str, dict]:
        out: dict[str, dict] = {}
        for r in self.results:
            d = out.setdefault(
                r.layer,
                {
                    "tokens": 0,
                    "cos": 0.0,
                    "err": 0.0,
                    "noise": 0.0,
                    "min_cosine": 1.0,
                    "max_abs_diff": 0.0,
                    "max_ratio": 0.0,
                    "failed": 0,
                    "near_ties": 0,
                },
            )
            d["tokens"] += r.tokens
            d["cos"] += r.mean_cosine * r.tokens
            d["err"] += r.mean_error * r.tokens
            d["noise"] += r.noise_error * r.tokens
            d["min_cosine"] = min(d["min_cosine"], r.min_cosine)
            d["max_abs_diff"] = max(d["max_abs_diff"], r.max_abs_diff)
            d["max_ratio"] = max(d["max_ratio"], r.ratio)
            d["failed"] += not r.passed
            d["near_ties"] += r.near_ties
        return {
            k: {
                "tokens": d["tokens"],
                "mean_cosine": d["cos"] / max(d["tokens"], 1),
                "mean_error": d["err"] / max(d["tokens"], 1),
                "bf16_error": d["noise"] / max(d["tokens"], 1),
                "max_ratio": d["max_ratio"],
                "min_cosine": d["min_cosine"],
                "max_abs_diff": d["max_abs_diff"],
                "failed": d["failed"],
                "routing_near_tie_tokens": d["near_ties"],
            }
            for k, d in out.items()
        }

    def to_json(self) -> dict:
        worst = self.worst()
        return {
            "output": self.output,
            "model": self.model,
            "device": self.device,
            "final_layer": self.final_layer,
            "reference": {
                "engine": "transformers (actors/hf/reference.py)",
                "runs": [f"{d}, {a} attention" for d, a in REFERENCE_RUNS],
                "roles": "the first is the truth, the others the bf16 yardsticks",
            },
            "rule": {**vars(self.rule), "text": self.rule.describe(), "why": RULE_WHY},
            "passed": self.ok,
            "samples": self.samples,
            "per_layer": self.per_layer(),
            "worst": {**vars(worst), "why": worst.why()} if worst else None,
            "failures": [{**vars(r), "excess": r.excess, "why": r.why()} for r in self.failures],
            "results": [{**vars(r), "excess": r.excess} for r in self.results],
            "seconds": round(self.seconds, 2),
            "created_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        }

    def text(self) -> str:
        lines = [
            f"audit of {len(self.samples)} samples from {self.output} against {self.model} ({self.device}):",
            f"  rule: {self.rule.describe()}",
            f"  final layer judged as stored: {self.final_layer.replace('_', '-')}",
        ]
        for layer, d in self.per_layer().items():
            near_ties = d["routing_near_tie_tokens"]
            lines.append(
                f"  {layer:>14}: distance {d['mean_error']:.4g} (bf16 forward {d['bf16_error']:.4g}), worst sample "
                f"{d['max_ratio']:.2f}x, mean cosine {d['mean_cosine']:.6f}, min {d['min_cosine']:.5f} "
                f"over {d['tokens']:,} tokens" + (f" ({near_ties:,} at MoE routing near ties)" if near_ties else "")
            )
        worst = self.worst()
        if self.ok:
            lines.append("PASS: every sample and layer is within bf16 noise")
        elif worst is None:
            lines.append("FAIL: nothing to audit (no committed samples)")
        else:
            lines.append(
                f"FAIL: {len(self.failures)} sample/layer pairs beyond bf16 noise; worst: sample {worst.sample_id!r}, "
                f"{worst.layer}: {worst.why()}, mean cosine {worst.mean_cosine:.5f}"
            )
        return "\n".join(lines)


RULE_WHY = (
    "a bf16 forward of the same tokens sets how far from float32 healthy data may be; the factors leave "
    "2x or more margin over healthy outputs and below damage (pipeline/tools/fidelity.py)"
)


def _f32(bits: np.ndarray) -> np.ndarray:
    """bf16 bits (uint16) -> float32, exactly."""
    return (bits.astype(np.uint32) << 16).view(np.float32)


def _cosines(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    dot = (a * b).sum(-1)
    na, nb = np.linalg.norm(a, axis=-1), np.linalg.norm(b, axis=-1)
    with np.errstate(invalid="ignore", divide="ignore"):
        cos = np.where((na == 0) & (nb == 0), 1.0, dot / (na * nb))
    return np.nan_to_num(cos, nan=0.0)


def compare(
    sample_id: str,
    layer: str,
    stored,
    truth,
    yardstick,
    rule: NoiseRule = DEFAULT_RULE,
    upstream=None,
    near_ties=None,
    quantized=None,
) -> LayerResult:
    """stored [T, H] against the float32 truth and a bf16 forward of the same tokens (float64 math);
    `upstream`: the yardsticks' per-token distances in the sample's shallower layers (fidelity.upstream_noise);
    `near_ties`: tokens at a MoE routing near tie (fidelity.near_tie_tokens); `quantized`: an fp8 output's
    per-value quantization bound [T, H] (NoiseRule.judge)."""
    a, b = as_float(stored), as_float(truth)
    d = rule.judge(a, b, yardstick, upstream, near_ties, quantized)
    if a.shape != b.shape:
        return LayerResult(sample_id, layer, d.tokens, 0.0, 0.0, float("inf"), *_deviation_fields(d))
    cos = _cosines(a, b)
    diff = float(np.nan_to_num(np.abs(a - b), nan=np.inf).max()) if a.size else 0.0
    return LayerResult(
        sample_id,
        layer,
        d.tokens,
        float(cos.mean()) if cos.size else 1.0,
        float(cos.min()) if cos.size else 1.0,
        diff,
        *_deviation_fields(d),
    )


def _deviation_fields(d: Deviation) -> tuple:
    return (
        d.mean_error,
        d.noise_error,
        d.worst_token,
        d.worst_error,
        d.worst_allowed,
        d.sample_allowed,
        d.passed,
        d.near_ties,
        d.peak_token,
        d.peak_error,
        d.peak_allowed,
    )


def judge_sample(
    decoded: dict, reference, aux_layers, hidden_size: int, rule: NoiseRule = DEFAULT_RULE, quantized=None
) -> list:
    """One decoded sample (pipeline.format.shards.decode_row, final="stored") against its reference
    (`Reference.samples`): a LayerResult per stored layer, the aux layers then the final. `quantized`: an
    fp8 sample's bounds (`quantization_bounds`), which widen each layer's allowance by what fp8 can cost."""
    truth, yard, ties = reference
    truth, yard = list(truth), list(yard)
    names = [f"aux layer {layer}" for layer in aux_layers] + ["final"]
    depths = [*aux_layers, FINAL_DEPTH]
    stored = _blocks_of(decoded, len(aux_layers), hidden_size)
    # Over every token, before a masked final state drops the untrained ones.
    tied = [near_tie_tokens(ties, depth) for depth in depths]
    ups = upstream_noise(truth, yard, depths, tied)
    if "last_hidden_state_positions" in decoded:  # masked outputs store the final state at trained positions only
        keep = decoded["last_hidden_state_positions"]
        truth[-1], yard[-1] = truth[-1][keep], tuple(y[keep] for y in yard[-1])
        ups[-1] = None if ups[-1] is None else ups[-1][keep]
        tied[-1] = None if tied[-1] is None else tied[-1].take(keep)
    sid = decoded["sample_id"]
    qs = [None] * len(names)
    if quantized is not None:
        aux_q, last_q = quantized
        qs = [aux_q[:, j * hidden_size : (j + 1) * hidden_size] for j in range(len(aux_layers))] + [last_q]
    return [compare(sid, *args, rule, u, e, q) for *args, u, e, q in zip(names, stored, truth, yard, ups, tied, qs)]


def _blocks_of(decoded: dict, k: int, h: int) -> list[np.ndarray]:
    aux = _f32(decoded["aux_hidden_states"])
    return [aux[:, j * h : (j + 1) * h] for j in range(k)] + [_f32(decoded["last_hidden_state"])]

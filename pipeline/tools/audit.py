"""`harvest audit`: recompute committed samples in float32 and compare them with what was stored.

The reference is the transformers engine (actors/hf/engine.py) run in float32 on the model the manifest
names, sharing no code with the SGLang capture path (server, hook, dump, validation). For each audited
sample and each stored layer (every aux layer, then the final state) it reports the per-token cosine
between stored bf16 and reference float32 (mean and minimum) and the largest absolute difference. A
sample/layer whose mean or minimum falls below the thresholds fails the audit; the report names the worst.

What it catches: a sample paired with another sample's states, a shifted or wrong layer, a truncated or
offset sequence, corrupted bytes that still decode, a different model. What it cannot: bf16 rounding,
which it is built to tolerate.
"""

from __future__ import annotations

import json
import logging
import random
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq

from pipeline.intake import model as model_lib
from pipeline.format.manifest import read_manifest
from pipeline.format.shards import decode_row, list_shards, read_layout, shard_sample_ids
from pipeline.format.storage import Store

logger = logging.getLogger(__name__)

AUDIT_REPORT = "audit.json"
DEFAULT_SAMPLES = 16


class AuditError(RuntimeError):
    """The audit cannot run (no manifest, model missing or different); the message says what to do."""


@dataclass(frozen=True)
class Thresholds:
    mean_cosine: float = 0.9995  # per sample and layer: the mean over its tokens
    min_cosine: float = 0.99  # per sample and layer: the worst token
    # per sample and layer: mean over tokens of | |stored| / |reference| - 1 |. Cosine is blind to scale;
    # a layer stored at twice its size (or the pre-norm state stored as the final one) fails this.
    max_norm_error: float = 0.02


@dataclass
class LayerResult:
    sample_id: str
    layer: str  # "aux layer 2", ..., "final"
    tokens: int
    mean_cosine: float
    min_cosine: float
    worst_token: int
    max_abs_diff: float
    norm_error: float = 0.0  # mean over tokens of | |stored| / |reference| - 1 |

    def passes(self, t: Thresholds) -> bool:
        return self.mean_cosine >= t.mean_cosine and self.min_cosine >= t.min_cosine and self.norm_error <= t.max_norm_error


@dataclass
class AuditReport:
    output: str
    model: str
    device: str
    thresholds: Thresholds
    samples: list[str] = field(default_factory=list)
    results: list[LayerResult] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def failures(self) -> list[LayerResult]:
        return [r for r in self.results if not r.passes(self.thresholds)]

    @property
    def ok(self) -> bool:
        return bool(self.results) and not self.failures

    def worst(self) -> LayerResult | None:
        if not self.results:
            return None
        # Among the failures when there are any (a sample failing on one bad token may have a higher mean
        # than a passing one): the one furthest below its thresholds (a low mean is worse than one bad token).
        t = self.thresholds
        return min(self.failures or self.results,
                   key=lambda r: (min(r.mean_cosine - t.mean_cosine, t.max_norm_error - r.norm_error), r.min_cosine))  # fmt: skip

    def per_layer(self) -> dict[str, dict]:
        out: dict[str, dict] = {}
        for r in self.results:
            d = out.setdefault(r.layer, {"tokens": 0, "sum": 0.0, "min_cosine": 1.0, "max_abs_diff": 0.0, "max_norm_error": 0.0})
            d["tokens"] += r.tokens
            d["sum"] += r.mean_cosine * r.tokens
            d["min_cosine"] = min(d["min_cosine"], r.min_cosine)
            d["max_abs_diff"] = max(d["max_abs_diff"], r.max_abs_diff)
            d["max_norm_error"] = max(d["max_norm_error"], r.norm_error)
        return {k: {"tokens": d["tokens"], "mean_cosine": d["sum"] / max(d["tokens"], 1), "min_cosine": d["min_cosine"],
                    "max_abs_diff": d["max_abs_diff"], "max_norm_error": d["max_norm_error"]} for k, d in out.items()}  # fmt: skip

    def to_json(self) -> dict:
        worst = self.worst()
        return {
            "output": self.output,
            "model": self.model,
            "device": self.device,
            "reference": "transformers, float32 (actors/hf/engine.py)",
            "thresholds": vars(self.thresholds),
            "passed": self.ok,
            "samples": self.samples,
            "per_layer": self.per_layer(),
            "worst": vars(worst) if worst else None,
            "failures": [vars(r) for r in self.failures],
            "results": [vars(r) for r in self.results],
            "seconds": round(self.seconds, 2),
            "created_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        }

    def text(self) -> str:
        lines = [f"audit of {len(self.samples)} samples from {self.output} against {self.model} (float32, {self.device}):"]
        for layer, d in self.per_layer().items():
            lines.append(f"  {layer:>14}: mean cosine {d['mean_cosine']:.6f}, min {d['min_cosine']:.5f}, "
                         f"max |diff| {d['max_abs_diff']:.4g}, norm error <= {d['max_norm_error']:.4f} over {d['tokens']:,} tokens")  # fmt: skip
        worst = self.worst()
        t = self.thresholds
        if self.ok:
            lines.append(f"PASS: every sample and layer has mean cosine >= {t.mean_cosine}, min >= {t.min_cosine} "
                         f"and norm error <= {t.max_norm_error}")  # fmt: skip
        elif worst is None:
            lines.append("FAIL: nothing to audit (no committed samples)")
        else:
            lines.append(f"FAIL: {len(self.failures)} sample/layer pairs outside mean cosine >= {t.mean_cosine} / min >= "
                         f"{t.min_cosine} / norm error <= {t.max_norm_error}; worst: sample {worst.sample_id!r}, {worst.layer}: "
                         f"mean {worst.mean_cosine:.5f}, min {worst.min_cosine:.5f} at token {worst.worst_token}, "
                         f"norm error {worst.norm_error:.4f}")  # fmt: skip
        return "\n".join(lines)


def _f32(bits: np.ndarray) -> np.ndarray:
    """bf16 bits (uint16) -> float32, exactly."""
    return (bits.astype(np.uint32) << 16).view(np.float32)


def compare(sample_id: str, layer: str, stored: np.ndarray, ref: np.ndarray) -> LayerResult:
    """Per-token cosine and max abs difference of stored [T, H] against reference [T, H] (float64 math)."""
    a, b = stored.astype(np.float64), ref.astype(np.float64)
    if a.shape != b.shape:
        return LayerResult(sample_id, layer, int(a.shape[0]), 0.0, 0.0, 0, float("inf"))
    dot = (a * b).sum(-1)
    na, nb = np.linalg.norm(a, axis=-1), np.linalg.norm(b, axis=-1)
    with np.errstate(invalid="ignore", divide="ignore"):
        cos = np.where((na == 0) & (nb == 0), 1.0, dot / (na * nb))
    cos = np.nan_to_num(cos, nan=0.0)
    if cos.size == 0:
        return LayerResult(sample_id, layer, 0, 1.0, 1.0, 0, 0.0)
    worst = int(np.argmin(cos))
    diff = np.abs(a - b)
    with np.errstate(invalid="ignore", divide="ignore"):
        ratio = np.where(nb == 0, np.where(na == 0, 1.0, np.inf), na / nb)
    norm_error = float(np.nan_to_num(np.abs(ratio - 1.0), nan=np.inf).mean())
    return LayerResult(sample_id, layer, int(cos.size), float(cos.mean()), float(cos[worst]), worst,
                       float(np.nan_to_num(diff, nan=np.inf).max()), norm_error)  # fmt: skip


def resolve_model_dir(manifest: dict, override: str | None) -> Path:
    """The model the output was made with: --model, else the manifest's path; its fingerprint must match."""
    recorded = (manifest.get("model") or {}).get("path")
    path = override or recorded
    if not path:
        raise AuditError("the manifest names no model; pass --model DIR")
    model_dir = model_lib.resolve_model(path) if path == "default" else Path(path)
    if not (model_dir / "config.json").is_file():
        raise AuditError(f"model directory {model_dir} not found (the manifest records {recorded!r}); pass --model DIR")
    want = manifest.get("data_settings", {}).get("model_sha256")
    if want and model_lib.model_fingerprint(model_dir) != want:
        raise AuditError(f"model at {model_dir} is not the one this output was made with (fingerprint differs)")
    return model_dir


def pick_samples(store: Store, samples: int | None, seed: int) -> dict[str, list[tuple[int, str]]]:
    """shard -> [(row, sample_id)] for N random committed samples (all of them when samples is None)."""
    every = [(rel, i, sid) for rel in list_shards(store) for i, sid in enumerate(shard_sample_ids(store, rel))]
    chosen = every if samples is None or samples >= len(every) else random.Random(seed).sample(every, samples)
    by_shard: dict[str, list[tuple[int, str]]] = {}
    for rel, i, sid in sorted(chosen):
        by_shard.setdefault(rel, []).append((i, sid))
    return by_shard


def audit(output: str, samples: int | None = DEFAULT_SAMPLES, device: str = "cpu", seed: int = 0,
          thresholds: Thresholds = Thresholds(), model: str | None = None, max_batch_tokens: int | None = None) -> AuditReport:  # fmt: skip
    from actors.hf.engine import HFEngine

    t0 = time.monotonic()
    store = Store(output)
    manifest = read_manifest(store)
    if manifest is None:
        raise AuditError(f"{store.display()} has no manifest.json: not a hidden-harvest output")
    model_dir = resolve_model_dir(manifest, model)
    aux_layers = tuple(manifest["data_settings"]["aux_layers"])
    report = AuditReport(store.display(), str(model_dir), device, thresholds)
    chosen = pick_samples(store, samples, seed)
    # On a CPU padding costs as much as real tokens and batching gains little: small batches (measured: half
    # the padded tokens and 30 % less time on the test output); a GPU wants large ones.
    batch_tokens = max_batch_tokens or (16384 if device.startswith("cuda") else 2048)
    # No warm-up: an audit's batches are few, and one that does not fit is split by the engine anyway.
    engine = HFEngine(str(model_dir), aux_layers, device=device, dtype="float32", capture=False,
                      max_batch_tokens=batch_tokens, warmup=False).start()  # fmt: skip
    try:
        for rel, rows in chosen.items():
            with store.fs.open(store.path(rel), "rb") as f:
                table = pq.read_table(f)
            meta = read_layout(table.schema)
            h = meta["hidden_size"]
            decoded = [decode_row(table, i, meta, as_torch=False, expand_last=False) for i, _ in rows]
            refs = engine.states([d["input_ids"].tolist() for d in decoded])
            for d, (ref_aux, ref_last) in zip(decoded, refs):
                sid = d["sample_id"]
                report.samples.append(sid)
                aux = _f32(d["aux_hidden_states"])
                for k, layer in enumerate(aux_layers):
                    cols = slice(k * h, (k + 1) * h)
                    report.results.append(compare(sid, f"aux layer {layer}", aux[:, cols], ref_aux[:, cols].numpy()))
                ref_last = ref_last.numpy()
                if "last_hidden_state_positions" in d:  # masked outputs store the final state at trained positions only
                    ref_last = ref_last[d["last_hidden_state_positions"]]
                report.results.append(compare(sid, "final", _f32(d["last_hidden_state"]), ref_last))
    finally:
        engine.close()
    report.seconds = time.monotonic() - t0
    store.write_bytes(AUDIT_REPORT, (json.dumps(report.to_json(), indent=2) + "\n").encode())
    return report

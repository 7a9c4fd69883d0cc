"""`harvest audit` itself: pick committed samples, run the reference on their tokens, judge every stored layer,
and write the report beside the output (audit.json)."""

from __future__ import annotations

import json
import logging
import random
import time
from pathlib import Path

import pyarrow.parquet as pq

from pipeline.format.codec import fp8_error_bound
from pipeline.format.manifest import read_manifest
from pipeline.format.shards import codec_of, decode_row, list_shards, read_layout, shard_sample_ids
from pipeline.format.storage import Store
from pipeline.intake import model as model_lib
from pipeline.tools.audit.judge import AuditReport, judge_sample
from pipeline.tools.audit.reference import Reference
from pipeline.tools.fidelity import DEFAULT_RULE, NoiseRule

logger = logging.getLogger(__name__)

AUDIT_REPORT = "audit.json"
DEFAULT_SAMPLES = 16


class AuditError(RuntimeError):
    """The audit cannot run (no manifest, model missing or different); the message says what to do."""


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


def audit(
    output: str,
    samples: int | None = DEFAULT_SAMPLES,
    device: str = "cpu",
    seed: int = 0,
    rule: NoiseRule = DEFAULT_RULE,
    model: str | None = None,
    max_batch_tokens: int | None = None,
) -> AuditReport:
    t0 = time.monotonic()
    store = Store(output)
    manifest = read_manifest(store)
    if manifest is None:
        raise AuditError(f"{store.display()} has no manifest.json: not a hidden-harvest output")
    model_dir = resolve_model_dir(manifest, model)
    aux_layers = tuple(manifest["data_settings"]["aux_layers"])
    # The stored final layer is judged as stored, against the reference's state at the same point.
    final_layer = manifest["data_settings"].get("final_layer", "post_norm")
    report = AuditReport(store.display(), str(model_dir), device, rule, final_layer)
    chosen = pick_samples(store, samples, seed)
    with Reference(model_dir, aux_layers, device, max_batch_tokens, final_layer) as reference:
        for rel, rows in chosen.items():
            with store.fs.open(store.path(rel), "rb") as f:
                table = pq.read_table(f)
            meta = read_layout(table.schema)
            decoded = [decode_row(table, i, meta, as_torch=False, expand_last=False, final="stored") for i, _ in rows]
            bounds = [quantization_bounds(table, i, meta, d) for (i, _), d in zip(rows, decoded)]
            refs = reference.samples([d["input_ids"].tolist() for d in decoded])
            for d, ref, q in zip(decoded, refs, bounds):
                report.samples.append(d["sample_id"])
                report.results += judge_sample(d, ref, aux_layers, meta["hidden_size"], rule, q)
    report.seconds = time.monotonic() - t0
    store.write_bytes(AUDIT_REPORT, (json.dumps(report.to_json(), indent=2) + "\n").encode())
    return report


def quantization_bounds(table, i: int, meta: dict, decoded: dict) -> tuple | None:
    """For an fp8 shard, per stored value the most quantization can have moved it: (aux [T, K*H], final
    [rows, H]) from the stored scales and codes; None for lossless encodings."""
    if meta.get("encoding") != "fp8":
        return None
    codec = codec_of(meta)
    aux_rows, last_rows = decoded["aux_hidden_states"].shape[0], decoded["last_hidden_state"].shape[0]
    h = meta["hidden_size"]
    return tuple(
        fp8_error_bound(codec.decode(table[col][i].as_buffer(), rows, width), rows, width, h)
        for col, rows, width in (
            ("aux_hidden_states", aux_rows, meta["aux_width"]),
            ("last_hidden_state", last_rows, h),
        )
    )

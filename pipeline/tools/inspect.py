"""`harvest inspect OUTPUT`: a short human summary read from the manifest and shard footers."""

from __future__ import annotations

import json

import pyarrow.parquet as pq

from pipeline.format.errors import ERROR_DIR
from pipeline.format.final_norm import FinalNorm
from pipeline.format.manifest import read_manifest
from pipeline.format.shards import list_shards, read_layout
from pipeline.format.storage import Store, human_bytes


def summarize(output: str) -> str:
    store = Store(output)
    manifest = read_manifest(store)
    if manifest is None:
        return f"{output}: no manifest.json (not a hidden-harvest output, or the first run never started)"
    shards = list_shards(store)
    lines = [f"output: {store.display()}  (status: {manifest.get('status')})"]
    lines.append(
        f"model: {manifest['model']['name']}  engine: {manifest['engine']['name']} {manifest['engine']['version']} on {manifest['engine']['device']}"
    )
    lines.append(
        f"aux layers: {manifest['aux_layers']}  hidden size: {manifest['hidden_size']}  dtype: {manifest['dtype']}"
    )
    t = manifest.get("totals") or {}
    if t:
        lines.append(
            f"samples: {t['samples_ok']:,} ok, {t['errors']:,} errors, {t['filtered']:,} filtered "
            f"(of {t.get('samples', '?')} samples from {t.get('input_rows', '?')} input rows); tokens: {t['tokens']:,}; bytes: {human_bytes(t['bytes'])} in {t['shards']} shards"
        )
        raw = t["tokens"] * (len(manifest["aux_layers"]) + 1) * manifest["hidden_size"] * 2
        if raw:
            lines.append(f"hidden-state storage: {t['bytes'] / raw:.3f} of raw bf16 ({human_bytes(raw)} raw)")
    conv = manifest.get("conversations")
    if conv:
        lines.append(
            f"conversations (extract.turns={conv['turns']}): {conv['conversations']:,}, {conv['full']:,} rendered whole, "
            f"{conv['each']:,} one sample per assistant turn; tokens {conv['tokens_chosen']:,} "
            f"(full {conv['tokens_full']:,}, each {conv['tokens_each']:,})"
        )
        if conv["unrendered"]:
            lines.append(f"  not rendered by the chat template (samples): {conv['unrendered']}")
    if shards:
        with store.fs.open(store.path(shards[0]), "rb") as f:
            pf = pq.ParquetFile(f)
            lines.append(f"schema ({len(shards)} shards, first {shards[0]}):")
            lines += [f"  {field.name}: {field.type}" for field in pf.schema_arrow]
            meta = read_layout(pf.schema_arrow)
            norm = meta.pop("final_norm", None)
            lines.append(f"  metadata: {json.dumps(meta)}")
            if norm is not None:
                lines.append(f"  final norm: {describe_final_norm(norm)}")
    errors = store.list(ERROR_DIR, ".jsonl")
    if errors:
        first = store.read_bytes(errors[0]).decode().splitlines()[:3]
        lines.append(f"errors: {len(errors)} files, e.g.:")
        lines += [f"  {json.loads(e)}" for e in first if e.strip()]
    return "\n".join(lines)


def describe_final_norm(norm: dict) -> str:
    """A shard's stored final norm in a line: its variant, eps, and its weight's sha256 and size; the weight
    itself (thousands of values) is left to the readers that apply it (pipeline/format/final_norm.py)."""
    try:
        fn = FinalNorm.from_json(norm)  # checks the weight against its recorded sha256
    except (ValueError, KeyError) as e:  # FinalNormError is a ValueError
        return f"cannot be read ({type(e).__name__}: {e})"
    return (
        f"variant {fn.variant}, eps {fn.eps:g}, weight float32 sha256 {norm['weight_sha256']}, "
        f"{fn.weight.nbytes:,} bytes ({fn.weight.size:,} values)"
    )

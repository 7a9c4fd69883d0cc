"""manifest.json: what produced the data, what it holds, and the totals read back from committed files.

The data settings (anything that changes the bytes of a sample) are compared before a rerun writes
into an existing output, so one output never mixes two models, layer sets or templates.
"""

from __future__ import annotations

import json
import logging
import time

import pyarrow.parquet as pq

from pipeline.format.errors import error_files, read_errors
from pipeline.format.shards import FORMAT_VERSION, list_shards
from pipeline.format.storage import Store, redact

logger = logging.getLogger(__name__)

MANIFEST = "manifest.json"
AUX_CONVENTION = "aux layer i = output of decoder layer i = HF hidden_states[i+1] (residual stream)"
LAST_CONVENTION = {
    "pre_norm": (
        "final residual stream, before the model's final norm (output of the last decoder layer); readers and "
        "exports apply data_settings.final_norm (stored in each shard's metadata) for the post-norm state"
    ),
    "post_norm": "final hidden state after the model's final norm",
}


class SettingsMismatch(RuntimeError):
    pass


def read_manifest(store: Store) -> dict | None:
    if not store.exists(MANIFEST):
        return None
    return json.loads(store.read_bytes(MANIFEST))


def write_manifest(store: Store, manifest: dict) -> None:
    manifest = dict(manifest, updated_at=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()))
    # Credentials never reach the manifest, even inside a URL a user put in the config.
    store.write_bytes(MANIFEST, (redact(json.dumps(manifest, indent=2, sort_keys=True)) + "\n").encode())


def check_settings(existing: dict | None, settings: dict) -> None:
    """Refuse to add data made with different settings to an existing output."""
    if existing is None:
        return
    old = existing.get("data_settings", {})
    diff = sorted(k for k in set(old) | set(settings) if old.get(k) != settings.get(k))
    if diff:
        lines = [f"  {k}: output has {old.get(k)!r}, this run has {settings.get(k)!r}" for k in diff]
        raise SettingsMismatch(
            f"output {existing.get('output', '')} was written with different data settings:\n"
            + "\n".join(lines)
            + "\nUse a new output.path, or rerun with the original settings."
        )


def committed_totals(store: Store) -> dict:
    """Totals from committed files only: shard footers and the num_tokens column, error files."""
    ok = tokens = nbytes = 0
    shards = list_shards(store)
    for rel in shards:
        with store.fs.open(store.path(rel), "rb") as f:
            t = pq.read_table(f, columns=["num_tokens"])
        ok += t.num_rows
        tokens += int(t["num_tokens"].to_numpy().sum()) if t.num_rows else 0
        nbytes += store.size(rel)
    counts = {"error": 0, "filtered": 0}
    for rel in error_files(store):
        for row in read_errors(store, rel):
            counts[row.status] = counts.get(row.status, 0) + 1
    return {
        "samples_ok": ok,
        "errors": counts["error"],
        "filtered": counts["filtered"],
        "tokens": tokens,
        "bytes": nbytes,
        "shards": len(shards),
    }


def trainer_layer_ids(aux_layers) -> dict:
    """Our aux ids in each draft trainer's naming (what its draft config must name; harvest export writes them)."""
    aux = [int(i) for i in aux_layers]
    return {
        "specforge (model.aux_hidden_state_layer_ids: 0-based layer outputs)": aux,
        "speculators (--target-layer-ids: HF hidden_states indices)": [i + 1 for i in aux],
        "modelopt (0-based layer outputs)": aux,
    }


def base_manifest(output: str, settings: dict, provenance: dict, config: dict) -> dict:
    return {
        "format_version": FORMAT_VERSION,
        "output": output,
        "data_settings": settings,
        "aux_layer_convention": AUX_CONVENTION,
        **({"trainer_layer_ids": trainer_layer_ids(settings["aux_layers"])} if "aux_layers" in settings else {}),
        "last_hidden_state": LAST_CONVENTION[settings.get("final_layer", "post_norm")],
        "dtype": "bfloat16",
        **provenance,
        "config": config,
    }

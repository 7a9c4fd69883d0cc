"""manifest.json: what produced the data, what it holds, and the totals read back from committed files.

The data settings (anything that changes the bytes of a sample) are compared before a rerun writes
into an existing output, so one output never mixes two models, layer sets or templates.
"""

from __future__ import annotations

import json
import logging
import time

import pyarrow.compute as pc

from pipeline.format.ids_index import committed_ids
from pipeline.format.shards import FORMAT_VERSION, SHARD_DIR
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


def committed_totals(store: Store, threads: int = 16) -> dict:
    """Totals from committed files only: their ids and token counts through the ids index (each file the index
    does not vouch for is read itself), their bytes from one listing."""
    sizes = store.list_sizes(SHARD_DIR, ".parquet")
    ok = tokens = 0
    counts = {"error": 0, "filtered": 0}
    for t in committed_ids(store, threads):
        statuses = t["status"].to_pylist()
        for status in set(statuses) - {"ok"}:
            counts[status] = counts.get(status, 0) + statuses.count(status)
        is_ok = pc.equal(t["status"], "ok")
        ok += int(pc.sum(is_ok.cast("int64")).as_py() or 0)
        tokens += int(pc.sum(pc.filter(t["num_tokens"], is_ok)).as_py() or 0)
    return {
        "samples_ok": ok,
        "errors": counts["error"],
        "filtered": counts["filtered"],
        "tokens": tokens,
        "bytes": sum(sizes.values()),
        "shards": len(sizes),
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

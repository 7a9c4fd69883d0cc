"""`harvest verify OUTPUT`: an integrity scan of committed output; exit code 0 only when everything holds.

Checks every shard opens, its schema and metadata match the manifest, its name matches the ids it holds,
token columns have num_tokens values and every hidden-state value decodes to [T, ...], no sample_id
appears twice (across shards, or in a shard and in errors/), and the manifest totals match what is there.
"""

from __future__ import annotations

import os
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np
import pyarrow.parquet as pq

from pipeline.format.errors import error_files, read_errors
from pipeline.format.manifest import read_manifest
from pipeline.format.shards import (
    codec_of,
    final_norm_of,
    hidden_bits,
    list_shards,
    read_layout,
    shard_name,
    stored_final_layer,
)
from pipeline.format.storage import Store


@dataclass
class Report:
    problems: list[str] = field(default_factory=list)
    shards: int = 0
    samples: int = 0
    tokens: int = 0
    bytes: int = 0

    @property
    def ok(self) -> bool:
        return not self.problems

    def text(self, output: str) -> str:
        head = f"{output}: {self.shards} shards, {self.samples:,} samples, {self.tokens:,} tokens, {self.bytes:,} bytes"
        if self.ok:
            return head + "\nOK: every check holds"
        return head + f"\nFAILED: {len(self.problems)} problem(s)\n" + "\n".join(f"  - {p}" for p in self.problems)


def _lengths(column) -> np.ndarray:
    arr = column.combine_chunks()
    return np.diff(arr.offsets.to_numpy())


def _check_hidden(rel: str, table, meta: dict, sids: list[str], rows: dict, report: Report) -> None:
    """Every hidden-state value decodes (codec and all) to exactly [rows, width]."""
    bad = 0
    codec = codec_of(meta) if meta.get("format_version", 1) >= 2 else None
    for name, (want, width) in rows.items():
        for i in range(table.num_rows):
            try:
                if codec is None:
                    hidden_bits(table, name, i, meta, int(want[i]), width)
                else:  # decompress only: the bytes are all there and the right size
                    codec.check(table[name][i].as_buffer(), int(want[i]), width)
            except ValueError as e:
                bad += 1
                if bad <= 3:
                    report.problems.append(
                        f"{rel}: sample {sids[i]} {name} does not decode to [{want[i]}, {width}]: {e}"
                    )


def _check_shard(store: Store, rel: str, expected: dict) -> tuple[Report, list[str]]:
    """One shard's findings and the ids it holds (shards are checked in parallel, merged in order)."""
    report = Report()
    try:
        with store.fs.open(store.path(rel), "rb") as f:
            table = pq.read_table(f)
        meta = read_layout(table.schema)
    except Exception as e:  # noqa: BLE001 -- any reader failure is a finding, not a crash of the scan
        report.problems.append(f"{rel}: cannot be read ({type(e).__name__}: {e})")
        return report, []
    for key in ("aux_layers", "hidden_size", "encoding", "last_hidden_state_rows"):
        if meta.get(key, "all" if key == "last_hidden_state_rows" else None) != expected.get(key):
            report.problems.append(f"{rel}: metadata {key}={meta.get(key)!r}, manifest says {expected.get(key)!r}")
    if stored_final_layer(meta) != expected.get("final_layer", "post_norm"):
        report.problems.append(
            f"{rel}: final layer {stored_final_layer(meta)}, manifest says {expected.get('final_layer', 'post_norm')}"
        )
    elif stored_final_layer(meta) == "pre_norm":
        try:
            sha = final_norm_of(meta).describe()["weight_sha256"]
        except (ValueError, KeyError) as e:  # FinalNormError is a ValueError
            report.problems.append(f"{rel}: its final norm cannot be read ({type(e).__name__}: {e})")
        else:
            if sha != (expected.get("final_norm") or {}).get("weight_sha256"):
                report.problems.append(f"{rel}: its final norm is not the one the manifest names")
    sids = table["sample_id"].to_pylist()
    if shard_name(sids) != rel:
        report.problems.append(f"{rel}: name does not match the sample ids it holds (copied or renamed shard?)")
    n = table["num_tokens"].to_numpy()
    mask_sums = np.array([int(np.sum(m)) for m in table["loss_mask"].to_numpy(zero_copy_only=False)])
    last_rows = mask_sums if meta.get("last_hidden_state_rows") == "masked" else n
    h, w = meta["hidden_size"], meta["aux_width"]
    for name, want in (("input_ids", n), ("loss_mask", n)):
        bad = np.flatnonzero(_lengths(table[name]) != want)
        for i in bad[:3]:
            report.problems.append(
                f"{rel}: sample {sids[i]} {name} has {_lengths(table[name])[i]} values, expected {want[i]}"
            )
    _check_hidden(rel, table, meta, sids, {"aux_hidden_states": (n, w), "last_hidden_state": (last_rows, h)}, report)
    report.shards += 1
    report.samples += table.num_rows
    report.tokens += int(n.sum())
    report.bytes += store.size(rel)
    return report, sids


def verify(output: str) -> Report:
    store = Store(output)
    report = Report()
    manifest = read_manifest(store)
    if manifest is None:
        report.problems.append("no manifest.json")
        return report
    expected = {
        **manifest["data_settings"],
        "aux_layers": manifest["aux_layers"],
        "hidden_size": manifest["hidden_size"],
    }
    ids: Counter = Counter()
    # Shards are independent and decompression releases the GIL: a few at once keep the disk and the
    # cores busy, where one at a time leaves both waiting on each other.
    with ThreadPoolExecutor(max(1, min(8, os.cpu_count() or 1))) as pool:
        for part, sids in pool.map(lambda rel: _check_shard(store, rel, expected), list_shards(store)):
            report.problems += part.problems
            report.shards += part.shards
            report.samples += part.samples
            report.tokens += part.tokens
            report.bytes += part.bytes
            ids.update(sids)
    dups = [sid for sid, c in ids.items() if c > 1]
    if dups:
        report.problems.append(f"{len(dups)} sample_id(s) in more than one shard, e.g. {dups[:3]}")
    error_ids = set()
    for rel in error_files(store):
        error_ids.update(row.sample_id for row in read_errors(store, rel))
    both = sorted(error_ids & set(ids))
    if both:
        report.problems.append(f"{len(both)} sample_id(s) both in a shard and in errors/, e.g. {both[:3]}")
    totals = manifest.get("totals") or {}
    if manifest.get("status") != "complete":
        report.problems.append(
            f"manifest status is {manifest.get('status')!r}: the last run did not finish; rerun to resume"
        )
    for key, have in (
        ("samples_ok", report.samples),
        ("tokens", report.tokens),
        ("bytes", report.bytes),
        ("shards", report.shards),
    ):
        if totals.get(key) != have:
            report.problems.append(f"manifest totals.{key}={totals.get(key)} but the shards hold {have}")
    # One input row gives one sample, or one per assistant turn under extract.turns=each/auto.
    expected = totals.get("samples", totals.get("input_rows"))
    if totals and totals.get("accounted") != expected:
        report.problems.append(f"manifest accounts for {totals.get('accounted')} of {expected} samples")
    return report

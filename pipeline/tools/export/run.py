"""The export itself: check the source, write each shard's samples on a thread pool, then the files of the
whole export and export.json, and read everything back through the trainer's layout."""

from __future__ import annotations

import json
import logging
import os
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np
import pyarrow.parquet as pq

from pipeline.format.manifest import read_manifest
from pipeline.format.shards import decode_row, list_shards, read_layout, stored_final_layer
from pipeline.format.storage import Store
from pipeline.tools.draft_vocab import DraftVocabError, check_vocab, select_vocab, target_vocab_size
from pipeline.tools.export.layout import ExportError, Layout
from pipeline.tools.export.modelopt import ModelOpt
from pipeline.tools.export.specforge import SpecForge
from pipeline.tools.export.speculators import Speculators, SpeculatorsFP8

logger = logging.getLogger(__name__)

TRAINERS = ("specforge", "speculators", "modelopt")
EXPORT_RECORD = "export.json"


@dataclass
class ExportReport:
    trainer: str
    dest: str
    samples: int = 0
    written: int = 0
    skipped: int = 0  # already in DEST from an earlier run
    bytes_written: int = 0
    verified: int = 0
    problems: list[str] = field(default_factory=list)
    seconds: float = 0.0
    next_step: str = ""  # how to train on it, with this export's paths and layer ids

    @property
    def ok(self) -> bool:
        return not self.problems and self.verified == self.samples

    def text(self) -> str:
        rate = self.bytes_written / max(self.seconds, 1e-9) / 1e9
        head = (
            f"export to {self.trainer} at {self.dest}: {self.samples} samples, {self.written} written "
            f"({self.bytes_written:,} bytes, {rate:.2f} GB/s), {self.skipped} already there, {self.verified} verified"
        )
        if self.ok:
            tail = f"\nnext: {self.next_step}" if self.next_step else ""
            return head + "\nPASS: every sample re-read through the trainer's layout equals the source" + tail
        return head + "\nFAIL: " + "; ".join(self.problems[:5])


LAYOUTS = {
    "specforge": SpecForge,
    "modelopt": ModelOpt,
    "speculators": Speculators,
    "speculators_fp8": SpeculatorsFP8,
}


def _check_source(store: Store, trainer: str) -> tuple[dict, tuple[int, ...], int]:
    manifest = read_manifest(store)
    if manifest is None:
        raise ExportError(f"{store.display()} has no manifest.json: not a hidden-harvest output")
    if manifest.get("status") != "complete":
        raise ExportError(f"{store.display()} is {manifest.get('status')!r}, not complete: finish the run first")
    settings = manifest["data_settings"]
    if settings.get("last_hidden_state_rows", "all") != "all":
        raise ExportError("the output keeps the final layer at trained positions only; trainers read every position")
    if trainer == "speculators" and settings.get("final_layer", "post_norm") != "pre_norm":
        raise ExportError(
            "speculators trains on the final layer before the norm; this output stores it after the norm (format "
            f"{manifest.get('format_version')}), from which it cannot be recovered: extract again with "
            "extract.final_layer=pre_norm"
        )
    return manifest, tuple(manifest["aux_layers"]), int(manifest["hidden_size"])


@dataclass(frozen=True)
class _Task:
    """One shard's export or verify: plain values (a Store is opened per task, as a worker process would)."""

    output: str
    dest: str
    trainer: str
    aux_layers: tuple[int, ...]
    hidden: int
    shard: str
    start: int  # the global index of the shard's first row
    rows: int  # from the footer export() read to number the files
    present: frozenset  # names of this shard's files already in DEST


def _layout(task: _Task) -> Layout:
    return LAYOUTS[task.trainer](task.aux_layers, task.hidden)


def _read(task: _Task, columns=None):
    src = Store(task.output)
    with src.fs.open(src.path(task.shard), "rb") as f:
        return pq.read_table(f, columns=columns)


def _export_shard(task: _Task):
    """(written, skipped, bytes written, [(sample_id, ids, mask)] in row order)."""
    layout, out = _layout(task), Store(task.dest)
    names = [layout.name(task.start + r) for r in range(task.rows)]
    rows, written, nbytes = [], 0, 0
    if all(n in task.present for n in names):  # a rerun: the token columns are all that is needed
        t = _read(task, ["sample_id", "input_ids", "loss_mask"])
        for r in range(t.num_rows):
            rows.append(
                (
                    t["sample_id"][r].as_py(),
                    t["input_ids"][r].values.to_numpy(zero_copy_only=False),
                    t["loss_mask"][r].values.to_numpy(zero_copy_only=False),
                )
            )
        return 0, len(names), 0, rows
    table = _read(task)
    meta = read_layout(table.schema)
    if layout.final == "pre_norm" and stored_final_layer(meta) != "pre_norm":
        raise ExportError(f"{task.shard}: stored after the final norm; {task.trainer} needs it before")
    for r, name in enumerate(names):
        s = decode_row(table, r, meta, as_torch=False, final=layout.final)
        rows.append((s["sample_id"], s["input_ids"], s["loss_mask"]))
        if name in task.present:
            continue
        written, nbytes = written + 1, nbytes + layout.write(out, name, task.start + r, s)
    return written, len(names) - written, nbytes, rows


def _verify_shard(task: _Task):
    """(samples equal to the source, problems)."""
    layout, out = _layout(task), Store(task.dest)
    table = _read(task)
    meta = read_layout(table.schema)
    problems, ok = [], 0
    for r in range(table.num_rows):
        name = layout.name(task.start + r)
        s = decode_row(table, r, meta, as_torch=False, final=layout.final)
        try:
            ids, mask, aux, last = layout.decode(out.read_bytes(name))
        except Exception as e:  # noqa: BLE001 -- an unreadable file is a finding
            problems.append(f"{name}: cannot be read ({type(e).__name__}: {e}; remove it and export again)")
            continue
        want_aux, want_last = layout.expected(s)
        same = (
            np.array_equal(ids, s["input_ids"])
            and (mask is None or np.array_equal(mask, s["loss_mask"]))
            and np.array_equal(aux, want_aux)
            and np.array_equal(last, want_last)
        )
        if same:
            ok += 1
        else:
            problems.append(f"{name}: differs from source sample {s['sample_id']} (remove it and export again)")
    return ok, problems


def _map(fn, tasks: list[_Task], workers: int):
    """Shards on a thread pool (zstd, numpy and file writes release the GIL): threads outpace spawned worker
    processes, whose start and imports cost more than the GIL does at these sizes
    (bench/results/export_loader_h200.json)."""
    if workers <= 1 or len(tasks) <= 1:
        yield from map(fn, tasks)
        return
    with ThreadPoolExecutor(min(workers, len(tasks))) as pool:
        yield from pool.map(fn, tasks)


def export(
    output: str,
    trainer: str,
    dest: str,
    workers: int | None = None,
    verify: bool = True,
    draft_vocab: int | None = None,
    target_vocab: int | None = None,
    fp8: bool | None = None,
) -> ExportReport:
    """Export `output` for `trainer` into `dest`; `workers` shards at once (default: the cores, at most 16).
    `draft_vocab=N` also writes the N-token draft vocabulary (`target_vocab`: the target's, when the manifest
    does not say it). `fp8` (speculators only): its FP8 files instead of bf16; None: FP8 for an fp8 output."""
    if trainer not in TRAINERS:
        raise ExportError(f"--to {trainer}: one of {', '.join(TRAINERS)}")
    t0 = time.monotonic()
    workers = max(1, workers or min(16, os.cpu_count() or 1))
    src, out = Store(output), Store(dest)
    manifest, aux_layers, hidden = _check_source(src, trainer)
    if fp8 is None:
        fp8 = trainer == "speculators" and manifest["data_settings"].get("encoding") == "fp8"
    if fp8 and trainer != "speculators":
        raise ExportError(f"--fp8: only speculators reads FP8 hidden states; {trainer} reads bf16")
    layout_name = "speculators_fp8" if fp8 else trainer
    vocab_size = None
    if draft_vocab is not None:
        try:
            vocab_size = target_vocab_size(manifest, target_vocab)
        except DraftVocabError as e:
            raise ExportError(str(e)) from None
    layout = LAYOUTS[layout_name](aux_layers, hidden)
    shards = list_shards(src)
    counts = []
    for rel in shards:
        with src.fs.open(src.path(rel), "rb") as f:
            counts.append(pq.ParquetFile(f).metadata.num_rows)
    starts = np.concatenate([[0], np.cumsum(counts)]).astype(int).tolist()
    report = ExportReport(trainer, out.display(), samples=int(starts[-1]))
    record = out.read_bytes(EXPORT_RECORD) if out.exists(EXPORT_RECORD) else None
    if record is not None and json.loads(record).get("source_manifest_sha") != _manifest_sha(manifest):
        raise ExportError(f"{out.display()} holds an export of another output (or of this one before a change)")
    if record is not None and json.loads(record).get("hidden_states_dtype", "bfloat16") != layout.dtype:
        raise ExportError(
            f"{out.display()} holds {json.loads(record).get('hidden_states_dtype', 'bfloat16')} hidden states; "
            f"this export writes {layout.dtype}: export into a new folder"
        )
    sub = os.path.dirname(layout.name(0))
    out.clean_temporaries(sub)
    present = set(out.list(sub))
    tasks = [
        _Task(
            output,
            dest,
            layout_name,
            aux_layers,
            hidden,
            rel,
            starts[j],
            counts[j],
            frozenset(n for i in range(starts[j], starts[j + 1]) if (n := layout.name(i)) in present),
        )
        for j, rel in enumerate(shards)
    ]
    rows: list = []
    for written, skipped, nbytes, shard_rows in _map(_export_shard, tasks, workers):
        report.written += written
        report.skipped += skipped
        report.bytes_written += nbytes
        rows.extend(shard_rows)  # in shard order: the global index
    tokens = masked_token_counts(rows)
    vocab = None
    if draft_vocab is not None:
        try:
            vocab = select_vocab(tokens, draft_vocab, vocab_size)
        except DraftVocabError as e:
            raise ExportError(str(e)) from None
    report.next_step = _write_side_files(out, trainer, layout, rows, tokens, manifest, vocab)
    if verify:
        for ok, problems in _map(_verify_shard, tasks, workers):
            report.verified += ok
            report.problems.extend(problems)
        report.problems.extend(_verify_side_files(out, layout, rows, tokens, vocab))
    else:
        report.verified = report.samples
    report.seconds = time.monotonic() - t0
    return report


def masked_token_counts(rows) -> Counter:
    """{token id: count} over trained (loss-masked) positions: what speculators' token_freq.pt holds."""
    tokens: Counter = Counter()
    for _, ids, mask in rows:
        values, counts = np.unique(ids[mask.astype(bool)], return_counts=True)
        tokens.update(dict(zip(values.tolist(), counts.tolist())))
    return tokens


def _manifest_sha(manifest: dict) -> str:
    import hashlib

    key = {k: manifest.get(k) for k in ("data_settings", "totals")}
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()


def _write_side_files(out: Store, trainer: str, layout: Layout, rows, tokens: Counter, manifest: dict, vocab) -> str:
    """Everything beside the per-sample files; returns the next step in words."""
    n_vocab = int(vocab[0].size) if vocab is not None else None
    model_path = (manifest.get("model") or {}).get("path") or "TARGET_MODEL"
    train_record, train_files, next_step = layout.training(out.display(), model_path, n_vocab)
    for name, data in train_files.items():
        out.write_bytes(name, data)
    layout.write_rows(out, rows, tokens)
    if vocab is not None:
        for name, data in layout.vocab_files(*vocab).items():
            out.write_bytes(name, data)
    record = {
        "trainer": trainer,
        "source": manifest.get("output"),
        "source_manifest_sha": _manifest_sha(manifest),
        "samples": len(rows),
        "final_layer": layout.final,
        "hidden_states_dtype": layout.dtype,
        "aux_layers (ours: decoder layer outputs = HF hidden_states[i+1])": list(layout.aux_layers),
        **layout.layer_ids(),
        "files": layout.name(-1).replace("-1", "{i}").replace("-00000001", "{i:09d}"),
        **({"draft_vocab": n_vocab, "target_vocab": int(vocab[1].size)} if vocab is not None else {}),
        **train_record,
        "sample_ids": [sid for sid, _, _ in rows],
    }
    out.write_bytes(EXPORT_RECORD, (json.dumps(record, indent=2) + "\n").encode())
    return next_step


def _verify_side_files(out: Store, layout: Layout, rows, tokens: Counter, vocab) -> list[str]:
    """Problems with the per-export files, read back the way the trainer reads them."""
    problems = layout.verify_rows(out, rows, tokens)
    return problems + (verify_vocab(out, layout, *vocab) if vocab is not None else [])


def verify_vocab(out: Store, layout: Layout, d2t: np.ndarray, t2d: np.ndarray) -> list[str]:
    try:
        got_d2t, got_t2d = layout.read_vocab(out, d2t.size)
    except Exception as e:  # noqa: BLE001
        return [f"the draft vocabulary cannot be read back ({type(e).__name__}: {e})"]
    problems = check_vocab(got_d2t, t2d if got_t2d is None else got_t2d, d2t.size, t2d.size)
    if not np.array_equal(got_d2t, d2t) or (got_t2d is not None and not np.array_equal(got_t2d, t2d)):
        problems.append("the draft vocabulary read back differs from the one selected")
    return problems

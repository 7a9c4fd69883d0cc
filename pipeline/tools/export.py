"""`harvest export OUT --to specforge|speculators|modelopt DEST`: an output in the layout a draft trainer reads.

One file per sample, named by the sample's place in the output (shards in name order, rows in order), so a
rerun writes the same names: files already in DEST are complete (each is written whole, then renamed) and
are skipped, and a killed export rerun completes with nothing written twice. Shards are exported in
parallel; every file written is read back through the trainer's layout and compared with the source
sample bit for bit before the export reports success.

What each trainer reads (from their own code):
  specforge    `{i:09d}.ckpt` torch files: input_ids, loss_mask int64 [T], aux_hidden_state bf16 [1, T, 3H],
               hidden_state bf16 [1, T, H] after the final norm; exactly three aux layers.
  modelopt     `{i:09d}.pt` torch files: input_ids, loss_mask int64 [T], aux_hidden_states [T, K*H],
               hidden_states [T, H] after the norm (hidden_states_prenorm False), conversation_id.
  speculators  `hidden_states/hs_{i}.safetensors`: hidden_states bf16 [T, K+1, H] (the aux layers, then
               the final layer *before* the norm), token_ids int64 [T]; plus `token_freq.pt` and
               `rows.jsonl` (input_ids, loss_mask, seq_len per row i: the columns of its Arrow dataset).
Layer ids: our aux layer i is HF hidden_states[i+1]; SpecForge and Model-Optimizer name the same layers by
output id (= ours), speculators by HF index (ours + 1, the final layer as N). `export.json` in DEST says
which ids the trainer's draft config must name.
"""

from __future__ import annotations

import io
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

logger = logging.getLogger(__name__)

TRAINERS = ("specforge", "speculators", "modelopt")
EXPORT_RECORD = "export.json"


class ExportError(ValueError):
    """An export that cannot be made as asked; the message says why and what to do."""


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
            return head + "\nPASS: every sample re-read through the trainer's layout equals the source"
        return head + "\nFAIL: " + "; ".join(self.problems[:5])


def _bf16(bits: np.ndarray):
    import torch

    return torch.from_numpy(np.ascontiguousarray(bits).view(np.int16)).view(torch.bfloat16)


def _bits(t) -> np.ndarray:
    import torch

    return t.contiguous().view(torch.int16).numpy().view(np.uint16)


def _torch_bytes(obj) -> bytes:
    import torch

    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


class _Layout:
    """One trainer's file for one sample, and how to read it back."""

    final = "post_norm"  # the final layer this trainer reads

    def __init__(self, aux_layers: tuple[int, ...], hidden: int):
        self.aux_layers, self.hidden = aux_layers, hidden

    def name(self, i: int) -> str:
        raise NotImplementedError

    def encode(self, i: int, s: dict):
        """What the file holds: bytes, or an object torch.save writes (straight into the file: copying into a
        buffer first holds the GIL, and shards are written on threads)."""
        raise NotImplementedError

    def write(self, out: Store, name: str, i: int, s: dict) -> int:
        """Write sample i's file whole under `name`; returns its size."""
        obj = self.encode(i, s)
        with out.open_atomic(name) as f:
            if isinstance(obj, bytes):
                f.write(obj)
            else:
                import torch

                torch.save(obj, f)
            return f.tell()

    def decode(self, data: bytes) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """(input_ids, loss_mask, aux bits [T, K*H], final bits [T, H]) as the trainer would load them."""
        raise NotImplementedError

    def layer_ids(self) -> dict:
        raise NotImplementedError


class _SpecForge(_Layout):
    def __init__(self, aux_layers, hidden):
        if len(aux_layers) != 3:
            raise ExportError(
                f"SpecForge's EAGLE-3 reads exactly 3 aux layers; this output has {len(aux_layers)} ({list(aux_layers)})"
            )
        super().__init__(aux_layers, hidden)

    def name(self, i):
        return f"{i:09d}.ckpt"  # SpecForge reads files in sorted path order

    def encode(self, i, s):
        import torch

        return {
            "input_ids": torch.from_numpy(s["input_ids"].astype(np.int64)),
            "loss_mask": torch.from_numpy(s["loss_mask"].astype(np.int64)),
            "aux_hidden_state": _bf16(s["aux_hidden_states"])[None],
            "hidden_state": _bf16(s["last_hidden_state"])[None],
        }

    def decode(self, data):
        import torch

        d = torch.load(io.BytesIO(data), weights_only=False)
        return (
            d["input_ids"].numpy(),
            d["loss_mask"].numpy(),
            _bits(d["aux_hidden_state"][0]),
            _bits(d["hidden_state"][0]),
        )

    def layer_ids(self):
        return {"aux_layer_ids (0-based decoder outputs, eagle_aux_hidden_state_layer_ids)": list(self.aux_layers)}


class _ModelOpt(_Layout):
    def name(self, i):
        return f"{i:09d}.pt"

    def encode(self, i, s):
        import torch

        return {
            "input_ids": torch.from_numpy(s["input_ids"].astype(np.int64)),
            "loss_mask": torch.from_numpy(s["loss_mask"].astype(np.int64)),
            "aux_hidden_states": _bf16(s["aux_hidden_states"]),
            "hidden_states": _bf16(s["last_hidden_state"]),
            "hidden_states_prenorm": False,
            "conversation_id": s["sample_id"],
        }

    def decode(self, data):
        import torch

        d = torch.load(io.BytesIO(data), weights_only=True)
        return d["input_ids"].numpy(), d["loss_mask"].numpy(), _bits(d["aux_hidden_states"]), _bits(d["hidden_states"])

    def layer_ids(self):
        return {"aux_layer_ids (0-based decoder outputs)": list(self.aux_layers)}


class _Speculators(_Layout):
    final = "pre_norm"  # its draft applies the verifier's norm itself

    def name(self, i):
        return f"hidden_states/hs_{i}.safetensors"

    def tensors(self, s) -> dict:
        import torch

        k, h = len(self.aux_layers), self.hidden
        aux = _bf16(s["aux_hidden_states"]).view(-1, k, h)
        final = _bf16(s["last_hidden_state"])[:, None]
        return {
            "hidden_states": torch.cat([aux, final], dim=1).contiguous(),
            "token_ids": torch.from_numpy(s["input_ids"].astype(np.int64)),
        }

    def write(self, out, name, i, s):
        # safetensors writes a file itself (the bytes it would return are built holding the GIL: 0.68 GB/s
        # against ~1.1 for the torch layouts on 16 threads); staged, then renamed or uploaded whole.
        from safetensors.torch import save_file

        tmp = out.stage(os.path.dirname(name))
        save_file(self.tensors(s), tmp)
        size = os.path.getsize(tmp)
        out.commit_staged(tmp, name)
        return size

    def decode(self, data):
        from safetensors.torch import load

        d = load(data)
        hs = d["hidden_states"]
        t = hs.shape[0]
        return d["token_ids"].numpy(), None, _bits(hs[:, :-1].reshape(t, -1)), _bits(hs[:, -1])

    def layer_ids(self):
        return {"hidden_state_layer_ids (HF hidden_states indices, aux then final)": [i + 1 for i in self.aux_layers]}


_LAYOUTS = {"specforge": _SpecForge, "modelopt": _ModelOpt, "speculators": _Speculators}


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


def _layout(task: _Task) -> _Layout:
    return _LAYOUTS[task.trainer](task.aux_layers, task.hidden)


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
        same = (
            np.array_equal(ids, s["input_ids"])
            and (mask is None or np.array_equal(mask, s["loss_mask"]))
            and np.array_equal(aux, s["aux_hidden_states"])
            and np.array_equal(last, s["last_hidden_state"])
        )
        if same:
            ok += 1
        else:
            problems.append(f"{name}: differs from source sample {s['sample_id']} (remove it and export again)")
    return ok, problems


def _map(fn, tasks: list[_Task], workers: int):
    """Shards on a thread pool (zstd, numpy and file writes release the GIL). Measured on 16 cores
    (bench/results/export_loader_h200.json): ~1 GB/s of raw bf16 with threads, 0.43-0.58 with spawned
    worker processes, whose start and imports cost more than the GIL does at these sizes."""
    if workers <= 1 or len(tasks) <= 1:
        yield from map(fn, tasks)
        return
    with ThreadPoolExecutor(min(workers, len(tasks))) as pool:
        yield from pool.map(fn, tasks)


def export(output: str, trainer: str, dest: str, workers: int | None = None, verify: bool = True) -> ExportReport:
    """Export `output` for `trainer` into `dest`; `workers` shards at once (default: the cores, at most 16)."""
    if trainer not in TRAINERS:
        raise ExportError(f"--to {trainer}: one of {', '.join(TRAINERS)}")
    t0 = time.monotonic()
    workers = max(1, workers or min(16, os.cpu_count() or 1))
    src, out = Store(output), Store(dest)
    manifest, aux_layers, hidden = _check_source(src, trainer)
    layout = _LAYOUTS[trainer](aux_layers, hidden)
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
    sub = os.path.dirname(layout.name(0))
    out.clean_temporaries(sub)
    present = set(out.list(sub))
    tasks = [
        _Task(
            output,
            dest,
            trainer,
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
    tokens: Counter = Counter()
    for written, skipped, nbytes, shard_rows in _map(_export_shard, tasks, workers):
        report.written += written
        report.skipped += skipped
        report.bytes_written += nbytes
        rows.extend(shard_rows)  # in shard order: the global index
    for _, ids, mask in rows:
        tokens.update(ids[mask.astype(bool)].tolist())
    _write_side_files(out, trainer, layout, rows, tokens, manifest)
    if verify:
        for ok, problems in _map(_verify_shard, tasks, workers):
            report.verified += ok
            report.problems.extend(problems)
    else:
        report.verified = report.samples
    report.seconds = time.monotonic() - t0
    return report


def _manifest_sha(manifest: dict) -> str:
    import hashlib

    key = {k: manifest.get(k) for k in ("data_settings", "totals")}
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()


def _write_side_files(out: Store, trainer: str, layout: _Layout, rows, tokens: Counter, manifest: dict) -> None:
    if trainer == "speculators":
        lines = [
            json.dumps({"input_ids": ids.tolist(), "loss_mask": mask.astype(int).tolist(), "seq_len": int(ids.size)})
            for _, ids, mask in rows
        ]
        out.write_bytes("rows.jsonl", ("\n".join(lines) + "\n").encode() if lines else b"")
        out.write_bytes("token_freq.pt", _torch_bytes(dict(sorted(tokens.items()))))
    record = {
        "trainer": trainer,
        "source": manifest.get("output"),
        "source_manifest_sha": _manifest_sha(manifest),
        "samples": len(rows),
        "final_layer": layout.final,
        "aux_layers (ours: decoder layer outputs = HF hidden_states[i+1])": list(layout.aux_layers),
        **layout.layer_ids(),
        "files": layout.name(-1).replace("-1", "{i}").replace("-00000001", "{i:09d}"),
        "sample_ids": [sid for sid, _, _ in rows],
    }
    out.write_bytes(EXPORT_RECORD, (json.dumps(record, indent=2) + "\n").encode())

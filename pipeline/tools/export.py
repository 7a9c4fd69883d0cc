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
               the final layer *before* the norm), token_ids int64 [T]; in DEST itself an HF `datasets`
               save_to_disk folder (input_ids, loss_mask, seq_len of row i) and `token_freq.pt`.
Layer ids: our aux layer i is HF hidden_states[i+1]; SpecForge and Model-Optimizer name the same layers by
output id (= ours), speculators by HF index (ours + 1, the final layer as N). `export.json` in DEST says
which ids the trainer's draft config must name.

`draft_vocab=N` also writes the draft vocabulary (pipeline/tools/draft_vocab.py) where each trainer looks for
it: speculators `d2t-N.npy` and `t2d-N.npy` (its CLI's default names for `--draft-vocab-size N`), SpecForge
`vocab_mapping-N.pt` ({d2t, t2d}, for `model.vocab_mapping_path`), Model-Optimizer `d2t-N.pth`.
"""

from __future__ import annotations

import io
import json
import logging
import os
import posixpath
import shlex
import shutil
import tempfile
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

logger = logging.getLogger(__name__)

TRAINERS = ("specforge", "speculators", "modelopt")
EXPORT_RECORD = "export.json"
SPECFORGE_CONFIG = "specforge.yaml"  # a SpecForge run config naming this export; the user adds training settings
ROWS_STAGING = ".rows-staging-"  # a datasets folder being built; a killed export leaves one, a rerun removes it


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


def _npy_bytes(a: np.ndarray) -> bytes:
    buf = io.BytesIO()
    np.save(buf, a)
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

    def vocab_files(self, d2t: np.ndarray, t2d: np.ndarray) -> dict[str, bytes]:
        """The draft vocabulary in this trainer's files: {name: bytes}."""
        raise NotImplementedError

    def training(self, dest: str, model_path: str, draft_vocab: int | None) -> tuple[dict, dict[str, bytes], str]:
        """(what export.json records, files to write, the next step in words) for training on this export."""
        raise NotImplementedError

    def read_vocab(self, out: Store, n: int) -> tuple[np.ndarray, np.ndarray | None]:
        raise NotImplementedError

    def expected(self, s: dict) -> tuple[np.ndarray, np.ndarray]:
        """(aux bits, final bits) a file of sample `s` must read back as: the source's own, bit for bit,
        unless the layout stores them lossily."""
        return s["aux_hidden_states"], s["last_hidden_state"]


class _SpecForge(_Layout):
    VOCAB = "vocab_mapping-{n}.pt"  # {d2t, t2d}, for model.vocab_mapping_path

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

    def training(self, dest, model_path, draft_vocab):
        import yaml

        model = {"target_model_path": model_path, "aux_hidden_state_layer_ids": list(self.aux_layers)}
        if draft_vocab:
            model["vocab_mapping_path"] = posixpath.join(dest, self.VOCAB.format(n=draft_vocab))
        config = {"model": model, "data": {"hidden_states_path": dest}, "training": {"strategy": "eagle3"}}
        step = f"specforge train --config {posixpath.join(dest, SPECFORGE_CONFIG)} (add your training settings to it)"
        return (
            {"specforge_config": SPECFORGE_CONFIG},
            {SPECFORGE_CONFIG: yaml.safe_dump(config, sort_keys=False).encode()},
            step,
        )

    def vocab_files(self, d2t, t2d):
        import torch

        return {
            self.VOCAB.format(n=d2t.size): _torch_bytes({"d2t": torch.from_numpy(d2t), "t2d": torch.from_numpy(t2d)})
        }

    def read_vocab(self, out, n):
        import torch

        d = torch.load(io.BytesIO(out.read_bytes(self.VOCAB.format(n=n))), weights_only=True)
        return d["d2t"].numpy(), d["t2d"].numpy()


class _ModelOpt(_Layout):
    # Its draft keeps d2t only. Not `.pt`: its dataset reads every `*.pt` under the folder as a conversation.
    VOCAB = "d2t-{n}.pth"

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

    def training(self, dest, model_path, draft_vocab):
        vocab = (
            f"; the draft vocabulary: {posixpath.join(dest, self.VOCAB.format(n=draft_vocab))}" if draft_vocab else ""
        )
        return (
            {},
            {},
            f"Model-Optimizer's offline EAGLE-3 data directory: {dest} (post-norm, hidden_states_prenorm False){vocab}",
        )

    def vocab_files(self, d2t, t2d):
        import torch

        return {self.VOCAB.format(n=d2t.size): _torch_bytes(torch.from_numpy(d2t))}

    def read_vocab(self, out, n):
        import torch

        return torch.load(io.BytesIO(out.read_bytes(self.VOCAB.format(n=n))), weights_only=True).numpy(), None


class _Speculators(_Layout):
    final = "pre_norm"  # its draft applies the verifier's norm itself
    VOCAB = "{k}-{n}.npy"  # d2t and t2d: the names its CLI loads for --draft-vocab-size N

    @property
    def hf_ids(self) -> list[int]:
        """Our aux ids as its --target-layer-ids: HF hidden_states indices (ours + 1)."""
        return [i + 1 for i in self.aux_layers]

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
        return {"target_layer_ids (HF hidden_states indices of the aux layers)": self.hf_ids}

    def training(self, dest, model_path, draft_vocab):
        args = [
            "--speculator-type",
            "eagle3",
            "--verifier-name-or-path",
            model_path,
            "--data-path",
            dest,
            "--target-layer-ids",
            *[str(i) for i in self.hf_ids],
            "--on-missing",
            "raise",  # every row has its file; never ask a vLLM server for one
            *(["--draft-vocab-size", str(draft_vocab)] if draft_vocab else []),
        ]
        return (
            {"speculators_train_args": args},
            {},
            "torchrun --nproc-per-node GPUS -m speculators.train " + shlex.join(args),
        )

    def vocab_files(self, d2t, t2d):
        return {self.VOCAB.format(k=k, n=d2t.size): _npy_bytes(a) for k, a in (("d2t", d2t), ("t2d", t2d))}

    def read_vocab(self, out, n):
        return tuple(np.load(io.BytesIO(out.read_bytes(self.VOCAB.format(k=k, n=n)))) for k in ("d2t", "t2d"))


class _SpeculatorsFP8(_Speculators):
    """speculators' own FP8 layout: `hidden_states` float8_e4m3fn [T, K+1, H] and `hidden_states_scales`
    float32 [T, 1, 1], one scale per token over all layers (its loader: fp8.to(bf16) * scale). Written from an
    fp8 output (the default there): the states are read back to bf16 and quantized again with its one scale
    per token (amax / 448), since ours has one per token per layer. The check compares the files' bytes with
    that quantization of the source, and their dequantized states with it."""

    FP8_MAX = 448.0

    def tensors(self, s) -> dict:
        import torch

        d = super().tensors(s)
        x = d["hidden_states"].float()
        amax = x.abs().amax(dim=(1, 2), keepdim=True)
        scale = torch.where(amax > 0, amax / self.FP8_MAX, torch.ones_like(amax))
        q = (x / scale).clamp_(-self.FP8_MAX, self.FP8_MAX).to(torch.float8_e4m3fn)
        return {
            "hidden_states": q.contiguous(),
            "hidden_states_scales": scale.contiguous(),
            "token_ids": d["token_ids"],
        }

    def decode(self, data):
        import torch
        from safetensors.torch import load

        d = load(data)
        hs = (d["hidden_states"].to(torch.bfloat16) * d["hidden_states_scales"]).to(torch.bfloat16)
        t = hs.shape[0]
        return d["token_ids"].numpy(), None, _bits(hs[:, :-1].reshape(t, -1)), _bits(hs[:, -1])

    def expected(self, s: dict) -> tuple[np.ndarray, np.ndarray]:
        return self.decode(_safetensors_bytes(self.tensors(s)))[2:]


def _dtype_of(layout: _Layout) -> str:
    return "float8_e4m3fn" if isinstance(layout, _SpeculatorsFP8) else "bfloat16"


def _safetensors_bytes(tensors: dict) -> bytes:
    from safetensors.torch import save

    return save(tensors)


_LAYOUTS = {
    "specforge": _SpecForge,
    "modelopt": _ModelOpt,
    "speculators": _Speculators,
    "speculators_fp8": _SpeculatorsFP8,
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
    """Shards on a thread pool (zstd, numpy and file writes release the GIL). Measured on 16 cores
    (bench/results/export_loader_h200.json): ~1 GB/s of raw bf16 with threads, 0.43-0.58 with spawned
    worker processes, whose start and imports cost more than the GIL does at these sizes."""
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
    layout = _LAYOUTS[layout_name](aux_layers, hidden)
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
    if record is not None and json.loads(record).get("hidden_states_dtype", "bfloat16") != _dtype_of(layout):
        raise ExportError(
            f"{out.display()} holds {json.loads(record).get('hidden_states_dtype', 'bfloat16')} hidden states; "
            f"this export writes {_dtype_of(layout)}: export into a new folder"
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
        report.problems.extend(_verify_side_files(out, trainer, layout, rows, tokens, vocab))
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


def _write_side_files(out: Store, trainer: str, layout: _Layout, rows, tokens: Counter, manifest: dict, vocab) -> str:
    """Everything beside the per-sample files; returns the next step in words."""
    n_vocab = int(vocab[0].size) if vocab is not None else None
    model_path = (manifest.get("model") or {}).get("path") or "TARGET_MODEL"
    train_record, train_files, next_step = layout.training(out.display(), model_path, n_vocab)
    for name, data in train_files.items():
        out.write_bytes(name, data)
    if trainer == "speculators":
        _write_rows_dataset(out, rows)
        out.write_bytes("token_freq.pt", _torch_bytes(dict(sorted(tokens.items()))))
    if vocab is not None:
        for name, data in layout.vocab_files(*vocab).items():
            out.write_bytes(name, data)
    record = {
        "trainer": trainer,
        "source": manifest.get("output"),
        "source_manifest_sha": _manifest_sha(manifest),
        "samples": len(rows),
        "final_layer": layout.final,
        "hidden_states_dtype": _dtype_of(layout),
        "aux_layers (ours: decoder layer outputs = HF hidden_states[i+1])": list(layout.aux_layers),
        **layout.layer_ids(),
        "files": layout.name(-1).replace("-1", "{i}").replace("-00000001", "{i:09d}"),
        **({"draft_vocab": n_vocab, "target_vocab": int(vocab[1].size)} if vocab is not None else {}),
        **train_record,
        "sample_ids": [sid for sid, _, _ in rows],
    }
    out.write_bytes(EXPORT_RECORD, (json.dumps(record, indent=2) + "\n").encode())
    return next_step


def _rows_table(rows):
    """input_ids, loss_mask (int64 lists) and seq_len per row: the columns speculators' ArrowDataset reads."""
    import pyarrow as pa

    lengths = np.array([ids.size for _, ids, _ in rows], dtype=np.int64)
    offsets = pa.array(np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32))
    flat = [np.concatenate([r[k] for r in rows]).astype(np.int64) if rows else np.zeros(0, np.int64) for k in (1, 2)]
    return pa.table(
        {
            "input_ids": pa.ListArray.from_arrays(offsets, pa.array(flat[0])),
            "loss_mask": pa.ListArray.from_arrays(offsets, pa.array(flat[1])),
            "seq_len": pa.array(lengths),
        }
    )


def _write_rows_dataset(out: Store, rows) -> None:
    """An HF `datasets` save_to_disk folder in DEST itself (torch format, as speculators' own preprocessing saves
    it), built beside DEST and then committed file by file; the files are the same on every rerun."""
    import datasets

    parent = out.path("") if out.local else None
    if parent is not None:
        os.makedirs(parent, exist_ok=True)
        for stale in [n for n in os.listdir(parent) if n.startswith(ROWS_STAGING)]:
            shutil.rmtree(os.path.join(parent, stale), ignore_errors=True)
    staging = tempfile.mkdtemp(prefix=ROWS_STAGING, dir=parent)
    try:
        ds = datasets.Dataset(_rows_table(rows))
        ds.set_format("torch")
        ds.save_to_disk(staging)
        for name in sorted(os.listdir(staging)):
            out.commit_staged(os.path.join(staging, name), name)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def _read_rows_dataset(out: Store):
    """The rows folder as speculators opens it (`datasets.load_from_disk`), from a local copy when DEST is remote."""
    import datasets

    if out.local:
        return datasets.load_from_disk(out.path(""), keep_in_memory=True)
    with tempfile.TemporaryDirectory() as tmp:
        for name in ("state.json", "dataset_info.json", *[n for n in out.list("", ".arrow")]):
            with open(os.path.join(tmp, os.path.basename(name)), "wb") as f:
                f.write(out.read_bytes(name))
        return datasets.load_from_disk(tmp, keep_in_memory=True)


def _verify_side_files(out: Store, trainer: str, layout: _Layout, rows, tokens: Counter, vocab) -> list[str]:
    """Problems with the per-export files, read back the way the trainer reads them."""
    problems = _verify_rows(out, rows, tokens) if trainer == "speculators" else []
    return problems + (_verify_vocab(out, layout, *vocab) if vocab is not None else [])


def _verify_rows(out: Store, rows, tokens: Counter) -> list[str]:
    import torch

    try:
        ds = _read_rows_dataset(out)
    except Exception as e:  # noqa: BLE001 -- an unreadable folder is a finding
        return [f"the rows folder cannot be opened with datasets.load_from_disk ({type(e).__name__}: {e})"]
    problems = []
    if len(ds) != len(rows):
        problems.append(f"the rows folder has {len(ds)} rows for {len(rows)} samples")
    else:
        for i, (sid, ids, mask) in enumerate(rows):
            row = ds[i]
            if not (
                torch.equal(row["input_ids"], torch.from_numpy(ids.astype(np.int64)))
                and torch.equal(row["loss_mask"], torch.from_numpy(mask.astype(np.int64)))
                and int(row["seq_len"]) == ids.size
            ):
                problems.append(f"rows folder row {i} differs from source sample {sid}")
    freq = torch.load(io.BytesIO(out.read_bytes("token_freq.pt")), weights_only=True)
    if freq != dict(tokens):
        problems.append("token_freq.pt differs from the loss-masked token counts of the source")
    return problems


def _verify_vocab(out: Store, layout: _Layout, d2t: np.ndarray, t2d: np.ndarray) -> list[str]:
    try:
        got_d2t, got_t2d = layout.read_vocab(out, d2t.size)
    except Exception as e:  # noqa: BLE001
        return [f"the draft vocabulary cannot be read back ({type(e).__name__}: {e})"]
    problems = check_vocab(got_d2t, t2d if got_t2d is None else got_t2d, d2t.size, t2d.size)
    if not np.array_equal(got_d2t, d2t) or (got_t2d is not None and not np.array_equal(got_t2d, t2d)):
        problems.append("the draft vocabulary read back differs from the one selected")
    return problems

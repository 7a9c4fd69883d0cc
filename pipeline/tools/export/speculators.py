"""speculators' layout: one safetensors file per sample (bf16, or its own FP8), the final layer before the norm,
and in DEST itself the rows as an HF `datasets` folder and the masked token counts (token_freq.pt)."""

from __future__ import annotations

import io
import os
import shlex
import shutil
import tempfile
from collections import Counter

import numpy as np

from pipeline.format.storage import Store
from pipeline.tools.export.layout import Layout, bf16_bits, bf16_tensor, npy_bytes, torch_bytes

ROWS_STAGING = ".rows-staging-"  # a datasets folder being built; a killed export leaves one, a rerun removes it


class Speculators(Layout):
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
        aux = bf16_tensor(s["aux_hidden_states"]).view(-1, k, h)
        final = bf16_tensor(s["last_hidden_state"])[:, None]
        return {
            "hidden_states": torch.cat([aux, final], dim=1).contiguous(),
            "token_ids": torch.from_numpy(s["input_ids"].astype(np.int64)),
        }

    def write(self, out, name, i, s):
        # safetensors writes a file itself: the bytes it would return are built holding the GIL, which slows
        # the threads that write shards (bench/results/export_loader_h200.json); staged, then renamed or
        # uploaded whole.
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
        return d["token_ids"].numpy(), None, bf16_bits(hs[:, :-1].reshape(t, -1)), bf16_bits(hs[:, -1])

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

    def write_rows(self, out, rows, tokens):
        _write_rows_dataset(out, rows)
        out.write_bytes("token_freq.pt", torch_bytes(dict(sorted(tokens.items()))))

    def verify_rows(self, out, rows, tokens):
        return _verify_rows(out, rows, tokens)

    def vocab_files(self, d2t, t2d):
        return {self.VOCAB.format(k=k, n=d2t.size): npy_bytes(a) for k, a in (("d2t", d2t), ("t2d", t2d))}

    def read_vocab(self, out, n):
        return tuple(np.load(io.BytesIO(out.read_bytes(self.VOCAB.format(k=k, n=n)))) for k in ("d2t", "t2d"))


class SpeculatorsFP8(Speculators):
    """speculators' own FP8 layout: `hidden_states` float8_e4m3fn [T, K+1, H] and `hidden_states_scales`
    float32 [T, 1, 1], one scale per token over all layers (its loader: fp8.to(bf16) * scale). Written from an
    fp8 output (the default there): the states are read back to bf16 and quantized again with its one scale
    per token (amax / 448), since ours has one per token per layer. The check compares the files' bytes with
    that quantization of the source, and their dequantized states with it."""

    FP8_MAX = 448.0
    dtype = "float8_e4m3fn"

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
        return d["token_ids"].numpy(), None, bf16_bits(hs[:, :-1].reshape(t, -1)), bf16_bits(hs[:, -1])

    def expected(self, s: dict) -> tuple[np.ndarray, np.ndarray]:
        return self.decode(_safetensors_bytes(self.tensors(s)))[2:]


def _safetensors_bytes(tensors: dict) -> bytes:
    from safetensors.torch import save

    return save(tensors)


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

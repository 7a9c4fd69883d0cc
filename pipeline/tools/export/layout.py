"""What every trainer layout of an export shares: the Layout interface (one sample's file, how the trainer
reads it back, its draft-vocabulary files and how to train on the export) and bf16 tensor helpers."""

from __future__ import annotations

import io

import numpy as np

from pipeline.format.storage import Store


class ExportError(ValueError):
    """An export that cannot be made as asked; the message says why and what to do."""


def bf16_tensor(bits: np.ndarray):
    """bf16 bits (uint16) as a torch bfloat16 tensor of the same values."""
    import torch

    return torch.from_numpy(np.ascontiguousarray(bits).view(np.int16)).view(torch.bfloat16)


def bf16_bits(t) -> np.ndarray:
    """A torch bfloat16 tensor's bits (uint16), to compare bit for bit."""
    import torch

    return t.contiguous().view(torch.int16).numpy().view(np.uint16)


def torch_bytes(obj) -> bytes:
    import torch

    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def npy_bytes(a: np.ndarray) -> bytes:
    buf = io.BytesIO()
    np.save(buf, a)
    return buf.getvalue()


class Layout:
    """One trainer's file for one sample, and how to read it back."""

    final = "post_norm"  # the final layer this trainer reads
    dtype = "bfloat16"  # the hidden states' dtype in its files

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

    def write_rows(self, out: Store, rows, tokens) -> None:
        """Files of the whole export beside the samples' (rows: [(sample_id, ids, mask)] in file order;
        tokens: the loss-masked token counts); none unless the trainer reads some."""

    def verify_rows(self, out: Store, rows, tokens) -> list[str]:
        """Problems with what `write_rows` wrote, read back the way the trainer reads it."""
        return []

    def expected(self, s: dict) -> tuple[np.ndarray, np.ndarray]:
        """(aux bits, final bits) a file of sample `s` must read back as: the source's own, bit for bit,
        unless the layout stores them lossily."""
        return s["aux_hidden_states"], s["last_hidden_state"]

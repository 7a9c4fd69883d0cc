"""Model-Optimizer's offline EAGLE-3 layout: one torch file per sample, post-norm."""

from __future__ import annotations

import io
import posixpath

import numpy as np

from pipeline.tools.export.layout import Layout, bf16_bits, bf16_tensor, torch_bytes


class ModelOpt(Layout):
    # Its draft keeps d2t only. Not `.pt`: its dataset reads every `*.pt` under the folder as a conversation.
    VOCAB = "d2t-{n}.pth"

    def name(self, i):
        return f"{i:09d}.pt"

    def encode(self, i, s):
        import torch

        return {
            "input_ids": torch.from_numpy(s["input_ids"].astype(np.int64)),
            "loss_mask": torch.from_numpy(s["loss_mask"].astype(np.int64)),
            "aux_hidden_states": bf16_tensor(s["aux_hidden_states"]),
            "hidden_states": bf16_tensor(s["last_hidden_state"]),
            "hidden_states_prenorm": False,
            "conversation_id": s["sample_id"],
        }

    def decode(self, data):
        import torch

        d = torch.load(io.BytesIO(data), weights_only=True)
        return (
            d["input_ids"].numpy(),
            d["loss_mask"].numpy(),
            bf16_bits(d["aux_hidden_states"]),
            bf16_bits(d["hidden_states"]),
        )

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

        return {self.VOCAB.format(n=d2t.size): torch_bytes(torch.from_numpy(d2t))}

    def read_vocab(self, out, n):
        import torch

        return torch.load(io.BytesIO(out.read_bytes(self.VOCAB.format(n=n))), weights_only=True).numpy(), None

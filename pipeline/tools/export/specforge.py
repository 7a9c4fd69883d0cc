"""SpecForge's layout: one torch file per sample, and a run config that names the export."""

from __future__ import annotations

import io
import posixpath

import numpy as np

from pipeline.tools.export.layout import ExportError, Layout, bf16_bits, bf16_tensor, torch_bytes

SPECFORGE_CONFIG = "specforge.yaml"  # a SpecForge run config naming this export; the user adds training settings


class SpecForge(Layout):
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
            "aux_hidden_state": bf16_tensor(s["aux_hidden_states"])[None],
            "hidden_state": bf16_tensor(s["last_hidden_state"])[None],
        }

    def decode(self, data):
        import torch

        d = torch.load(io.BytesIO(data), weights_only=False)
        return (
            d["input_ids"].numpy(),
            d["loss_mask"].numpy(),
            bf16_bits(d["aux_hidden_state"][0]),
            bf16_bits(d["hidden_state"][0]),
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
            self.VOCAB.format(n=d2t.size): torch_bytes({"d2t": torch.from_numpy(d2t), "t2d": torch.from_numpy(t2d)})
        }

    def read_vocab(self, out, n):
        import torch

        d = torch.load(io.BytesIO(out.read_bytes(self.VOCAB.format(n=n))), weights_only=True)
        return d["d2t"].numpy(), d["t2d"].numpy()

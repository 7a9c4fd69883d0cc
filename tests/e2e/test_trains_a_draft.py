"""The data trains a draft, with a trainer nobody here wrote: the default run, exported to speculators' layout,
read by speculators' own `ArrowDataset` and `CollateFn`, trains its own EAGLE-3 draft model on the CPU. And
SpecForge's own offline reader, in a throwaway environment, reads the SpecForge export back as the source.

speculators 0.9.0 (pinned beside our torch and transformers) supplies everything that touches the data: the reader
(`datasets.load_from_disk` of the rows, `hs_{i}.safetensors` matched by token ids), the packing collate, the draft
vocabulary read as its CLI reads it (`d2t-N.npy`, `t2d-N.npy`), the draft (`Eagle3DraftModel.from_training_args`,
embeddings, lm_head and final norm from the target's own files; the target's logits for the loss come from our
final layer through its `verifier_norm` and `verifier_lm_head`) and its loss and metrics. The test supplies only
the loop its `Trainer` runs (which wants a GPU): autocast, AdamW at its default lr, clip at 1.0. Its flex attention
has no CPU backward and its fused loss is a Triton kernel, so the draft runs eager attention and the eager loss.
Autocast is to bf16, as the Trainer's, where the CPU multiplies bf16 natively; elsewhere the step runs in float32
on the stored bf16 states widened exactly: emulated bf16 took ~15 s a step against ~0.6 s on a 2-core AVX2 CPU.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch

from actors.cpu import cpu_has_bf16_matmul

pytestmark = pytest.mark.slow

DRAFT_VOCAB = 1024  # SmolLM2's vocabulary is 49,152: a pruned draft vocabulary, as trainers use
MAX_LEN = 512  # tokens packed per step
STEPS = 36
# bf16 autocast where the CPU has bf16 matmul, else float32 (the engine's own rule for a CPU server's dtype).
AUTOCAST_BF16 = cpu_has_bf16_matmul() is not False


def _batches(ds, seed: int | None):
    from speculators.train.data import CollateFn

    collate = CollateFn(MAX_LEN, hidden_size=ds[0]["verifier_last_hidden_states"].shape[-1], num_target_layers=3)
    gen = torch.Generator().manual_seed(seed) if seed is not None else None
    loader = torch.utils.data.DataLoader(ds, batch_size=2, shuffle=seed is not None, generator=gen, collate_fn=collate)
    for batch in loader:
        assert batch["error_records"] == 0  # every row found its hidden states, token ids equal
        tensors = {k: v for k, v in batch.items() if isinstance(v, torch.Tensor)}
        if not AUTOCAST_BF16:  # bf16 widens to float32 exactly: the same data, computed in float32
            tensors = {k: v.float() if v.is_floating_point() else v for k, v in tensors.items()}
        yield tensors


def _step_metrics(model, batch, kwargs) -> tuple[torch.Tensor, dict]:
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=AUTOCAST_BF16):
        _, loss, metrics = model(**batch, **kwargs)
    return loss, metrics


def _accuracy(model, ds, kwargs) -> float:
    """The draft's first-step next-token accuracy over every trained token of the data (full_acc_0)."""
    model.eval()
    right = total = 0.0
    with torch.no_grad():
        for batch in _batches(ds, seed=None):
            _, m = _step_metrics(model, batch, kwargs)
            right, total = right + float(m["full_acc_0_sum"]), total + float(m["full_acc_0_total"])
    model.train()
    return right / total


def test_speculators_trains_its_eagle3_draft_on_the_default_run(harvest_run, model_dir, tmp_path):
    from speculators.models.eagle3 import Eagle3DraftModel
    from speculators.train.cli import create_transformer_layer_config
    from speculators.train.config import TrainConfig
    from speculators.train.data import ArrowDataset

    from pipeline.cli import main

    out, summary = harvest_run
    dest = tmp_path / "speculators"
    assert main(["export", str(out), "--to", "speculators", str(dest), "--draft-vocab", str(DRAFT_VOCAB)]) == 0
    # The arguments the export names for speculators' own CLI, parsed by that CLI: what training would run on.
    args = json.loads((dest / "export.json").read_text())["speculators_train_args"]
    cfg = TrainConfig.resolve(args).flatten()
    assert cfg["data_path"] == str(dest) and cfg["verifier_name_or_path"] == str(model_dir)
    assert cfg["draft_vocab_size"] == DRAFT_VOCAB and cfg["on_missing"] == "raise"

    ds = ArrowDataset(max_len=MAX_LEN, datapath=cfg["data_path"], on_missing=cfg["on_missing"])
    assert len(ds) == summary.totals["samples_ok"]
    # Its vocabulary mapping, loaded as its CLI loads `--draft-vocab-size N` from the data folder.
    d2t = torch.from_numpy(np.load(dest / f"d2t-{DRAFT_VOCAB}.npy"))
    t2d = torch.from_numpy(np.load(dest / f"t2d-{DRAFT_VOCAB}.npy"))
    torch.manual_seed(0)
    layer_config = create_transformer_layer_config(
        verifier_name_or_path=str(model_dir),
        num_layers=1,
        draft_arch="llama",
        hidden_act=None,
        sliding_window=None,
        full_attention_indices=[0],
    )
    model = Eagle3DraftModel.from_training_args(
        verifier_config=layer_config,
        t2d=t2d,
        d2t=d2t,
        verifier_name_or_path=cfg["verifier_name_or_path"],
        draft_vocab_size=cfg["draft_vocab_size"],
        norm_before_residual=True,
        ttt_steps=3,
        target_layer_ids=cfg["target_layer_ids"],
        draft_attn_impl="eager",
    )
    kwargs, _ = Eagle3DraftModel.get_trainer_kwargs(
        loss_fn="kl_div", loss_implementation="eager", ttt_steps=3, ttt_step_loss_decay=1.0
    )
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)

    before = _accuracy(model, ds, kwargs)
    losses: list[float] = []
    epoch = 0
    while len(losses) < STEPS:
        for batch in _batches(ds, seed=epoch):
            loss, _ = _step_metrics(model, batch, kwargs)
            optimizer.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            losses.append(loss.item())
            if len(losses) == STEPS:
                break
        epoch += 1
    after = _accuracy(model, ds, kwargs)

    first, last = np.mean(losses[:6]), np.mean(losses[-6:])
    print(f"loss {first:.3f} -> {last:.3f} over {STEPS} steps; next-token accuracy {before:.3f} -> {after:.3f}")
    assert last < 0.7 * first, losses
    assert after > before + 0.10, (before, after)


# SpecForge pins another torch and SGLang, so it cannot live in our environment; its offline reader and the
# EAGLE-3 normalizer import nothing but torch and its own modules, so the package alone (no dependencies) runs them.
SPECFORGE = "specforge==0.2.0"
SPECFORGE_READ = textwrap.dedent(
    """
    import sys, torch
    from specforge.algorithms.eagle3.data import build_offline_normalizer, build_offline_reader
    from specforge.runtime.data_plane.feature_store import LocalFeatureStore

    from specforge.config import load_config

    config, result, max_len = load_config(sys.argv[1]), sys.argv[2], int(sys.argv[3])
    hidden = config.data.hidden_states_path
    reader = build_offline_reader(hidden, run_id="harvest", ttt_length=config.training.ttt_length, max_len=max_len)
    normalize, store, samples = build_offline_normalizer(max_len), LocalFeatureStore(), []
    for ref in reader.read():
        tensors, handle = store.get(ref)
        samples.append({k: v.clone() for k, v in normalize(tensors).items()})
        store.release(handle)
    mapping = torch.load(config.model.vocab_mapping_path)  # as its draft's load_vocab_mapping reads it
    torch.save({"samples": samples, "aux_layers": config.model.aux_hidden_state_layer_ids,
                "target": config.model.target_model_path, "d2t": mapping["d2t"], "t2d": mapping["t2d"]}, result)
    """
)


def test_specforges_own_reader_reads_the_export_as_the_source(harvest_run, model_dir, tmp_path):
    """SpecForge's config loader, offline EAGLE-3 reader, file store and normalizer over `harvest export --to
    specforge`, through the `specforge.yaml` the export writes: the samples in our order, the aux layers as stored,
    the target after the final norm, its loss mask, the layer ids and the draft vocabulary its config names."""
    from pipeline.cli import main
    from pipeline.format.final_norm import read_final_norm
    from pipeline.format.manifest import read_manifest
    from pipeline.format.shards import open_shards
    from pipeline.format.storage import Store

    out, _ = harvest_run
    dest, site = tmp_path / "specforge", tmp_path / "site"
    assert main(["export", str(out), "--to", "specforge", str(dest), "--draft-vocab", str(DRAFT_VOCAB)]) == 0
    pip = [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--target", str(site), SPECFORGE]
    subprocess.run(pip, check=True, timeout=300)
    script = tmp_path / "read.py"
    script.write_text(SPECFORGE_READ)
    max_len = 4096  # above every sample here: nothing is cut
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(site), "HOME": str(tmp_path)}
    done = subprocess.run(
        [sys.executable, str(script), str(dest / "specforge.yaml"), str(tmp_path / "read.pt"), str(max_len)],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    got = torch.load(tmp_path / "read.pt", weights_only=False)
    read = got["samples"]
    assert got["aux_layers"] == read_manifest(Store(str(out)))["aux_layers"] and got["target"] == str(model_dir)
    assert got["d2t"].shape == (DRAFT_VOCAB,) and int(got["t2d"].sum()) == DRAFT_VOCAB
    assert torch.equal(got["d2t"] + torch.arange(DRAFT_VOCAB), torch.nonzero(got["t2d"]).flatten())
    order = json.loads((dest / "export.json").read_text())["sample_ids"]
    source = {s["sample_id"]: s for s in open_shards(str(out), as_torch=False, final="stored")}
    norm = read_final_norm(model_dir)
    assert len(read) == len(order) == len(source)

    def bits(t):
        return t[0].contiguous().view(torch.int16).numpy().view(np.uint16)

    for sid, got in zip(order, read):
        s = source[sid]
        assert got["input_ids"][0].tolist() == s["input_ids"].tolist()
        want_mask = s["loss_mask"].astype(np.int64)
        want_mask[-1] = 0  # SpecForge zeroes the last position itself
        assert got["loss_mask"][0].tolist() == want_mask.tolist()
        assert np.array_equal(bits(got["hidden_state"]), s["aux_hidden_states"])
        assert np.array_equal(bits(got["target"]), norm.apply_bits(s["last_hidden_state"]))

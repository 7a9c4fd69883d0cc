"""The final norm stored with pre-norm outputs (pipeline/format/final_norm.py): read from the model's own files,
applied as the model applies it, carried in every shard and applied on read; format-2 outputs stay readable."""

from __future__ import annotations

import json
import shutil
import struct

import numpy as np
import pytest

from pipeline.format.final_norm import FinalNorm, FinalNormError, read_final_norm, to_bf16_bits
from pipeline.format.shards import ShardLayout, encode_bits, open_shards, write_shard
from pipeline.format.storage import Store
from tests_support import random_bf16


def _bf16_tensor(bits):
    import torch

    return torch.from_numpy(np.ascontiguousarray(bits).view(np.int16)).view(torch.bfloat16)


def _cosines(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return (a * b).sum(-1) / (np.linalg.norm(a, axis=-1) * np.linalg.norm(b, axis=-1))


def _states(rng, t=200, h=576):
    """bf16 bits of residual-stream-like states: varied scale per token, a few outlier channels."""
    x = rng.standard_normal((t, h)).astype(np.float32) * rng.uniform(0.5, 40, (t, 1)).astype(np.float32)
    x[:, [3, h // 2 + 5]] *= 25
    return to_bf16_bits(x)


def test_the_default_models_norm_is_read_from_its_files(model_dir):
    import torch
    from safetensors.torch import load_file as load_torch

    norm = read_final_norm(model_dir)
    config = json.loads((model_dir / "config.json").read_text())
    assert norm.variant == "rms" and norm.eps == config["rms_norm_eps"]
    (path,) = model_dir.glob("*.safetensors")
    want = load_torch(str(path))["model.norm.weight"].to(torch.float32).numpy()
    np.testing.assert_array_equal(norm.weight, want)


@pytest.mark.parametrize("family", ["llama", "gemma"])
def test_post_norm_from_pre_norm_matches_the_models_own_norm(model_dir, family):
    """transformers' own RMSNorm module of each variant, in bf16 as the model runs it, against ours from the same
    bf16 input: every token at cosine >= 0.9999, most values bit-identical (theirs rounds twice, ours once)."""
    import torch

    base = read_final_norm(model_dir)
    rng = np.random.default_rng(0)
    if family == "llama":
        from transformers.models.llama.modeling_llama import LlamaRMSNorm as Norm

        ours = base
        weight = torch.from_numpy(base.weight)
    else:
        from transformers.models.gemma.modeling_gemma import GemmaRMSNorm as Norm

        weight = torch.from_numpy(base.weight - 1.0)  # Gemma stores zero-centred weights and scales by (1 + w)
        ours = FinalNorm("rms_one_plus", base.eps, base.weight - np.float32(1.0))
    module = Norm(weight.numel(), eps=base.eps)
    module.weight.data = weight.clone()
    module = module.to(torch.bfloat16)
    pre = _states(rng)
    with torch.no_grad():
        theirs = module(_bf16_tensor(pre)).view(torch.int16).numpy().view(np.uint16)
    got = ours.apply_bits(pre)
    f32 = lambda b: (b.astype(np.uint32) << 16).view(np.float32)  # noqa: E731
    cos = _cosines(f32(got), f32(theirs))
    same = float((got == theirs).mean())
    print(f"\n{family}: min cosine {cos.min():.7f}, bit-identical {same:.1%}")
    assert cos.min() >= 0.9999 and same > 0.5


def test_the_norm_round_trips_through_json_and_refuses_a_damaged_weight():
    norm = FinalNorm("rms", 1e-6, np.arange(8, dtype=np.float32) / 7)
    back = FinalNorm.from_json(json.loads(json.dumps(norm.to_json())))
    assert back.variant == "rms" and back.eps == 1e-6 and np.array_equal(back.weight, norm.weight)
    assert "weight_float32_base64" not in norm.describe() and norm.describe()["weight_sha256"]
    bad = norm.to_json() | {"weight_sha256": "0" * 64}
    with pytest.raises(FinalNormError, match="sha256"):
        FinalNorm.from_json(bad)
    with pytest.raises(FinalNormError, match="variant"):
        FinalNorm("layernorm", 1e-6, norm.weight)
    with pytest.raises(ValueError, match="width"):
        norm.apply(np.zeros((2, 4), np.float32))


def test_rounding_to_bf16_is_to_nearest_even():
    import torch

    x = np.random.default_rng(1).standard_normal(10000).astype(np.float32) * 1000
    want = torch.from_numpy(x).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
    np.testing.assert_array_equal(to_bf16_bits(x), want)


def _fake_model(tmp_path, config: dict, tensors: dict[str, np.ndarray], index: bool = False):
    """A model directory with config.json and one safetensors file written by hand (F32 tensors)."""
    d = tmp_path / "model"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(config))
    header, body = {}, b""
    for name, t in tensors.items():
        raw = np.ascontiguousarray(t, "<f4").tobytes()
        header[name] = {"dtype": "F32", "shape": list(t.shape), "data_offsets": [len(body), len(body) + len(raw)]}
        body += raw
    head = json.dumps(header).encode()
    fname = "model-00001-of-00001.safetensors" if index else "model.safetensors"
    (d / fname).write_bytes(struct.pack("<Q", len(head)) + head + body)
    if index:
        (d / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {n: fname for n in tensors}}))
    return d


def test_read_final_norm_across_layouts_and_families(tmp_path):
    w = np.linspace(-1, 1, 16, dtype=np.float32)
    text = {"model_type": "gemma3_text", "hidden_size": 16, "rms_norm_eps": 1e-6}
    d = _fake_model(
        tmp_path,
        {"model_type": "gemma3", "text_config": text},
        {"model.language_model.norm.weight": w, "model.language_model.layers.0.input_layernorm.weight": w * 0},
        index=True,
    )
    norm = read_final_norm(d)
    assert norm.variant == "rms_one_plus" and norm.eps == 1e-6 and np.array_equal(norm.weight, w)
    np.testing.assert_allclose(norm.scale, w + 1)
    shutil.rmtree(d)
    d = _fake_model(tmp_path, {"model_type": "qwen3", "hidden_size": 16}, {"model.norm.weight": w})
    with pytest.raises(FinalNormError, match="rms_norm_eps.*extract.final_layer=post_norm"):
        read_final_norm(d)
    shutil.rmtree(d)
    d = _fake_model(tmp_path, {"model_type": "qwen3", "hidden_size": 16, "rms_norm_eps": 1e-6}, {"lm_head.weight": w})
    with pytest.raises(FinalNormError, match="no final norm weight.*extract.final_layer=post_norm"):
        read_final_norm(d)
    shutil.rmtree(d)
    d = _fake_model(tmp_path, {"model_type": "qwen3", "hidden_size": 8, "rms_norm_eps": 1e-6}, {"model.norm.weight": w})
    with pytest.raises(FinalNormError, match="shape"):
        read_final_norm(d)


@pytest.mark.parametrize("rows", ["all", "masked"])
def test_a_pre_norm_output_reads_post_norm_by_default_and_pre_norm_when_asked(tmp_path, rows):
    rng = np.random.default_rng(2)
    norm = FinalNorm("rms", 1e-5, rng.uniform(0.5, 2, 32).astype(np.float32))
    layout = ShardLayout((1, 2), 32, last_rows=rows, final_norm=norm)
    t = 12
    mask = [0] * 5 + [1] * 7
    pre = _states(rng, t, 32)
    aux = random_bf16(rng, t, layout.aux_width)
    write_shard(Store(str(tmp_path)), [encode_bits("a", list(range(t)), mask, aux, pre, layout)], layout)
    keep = np.flatnonzero(mask) if rows == "masked" else np.arange(t)
    (post,) = open_shards(str(tmp_path), as_torch=False, expand_last=False)
    (stored,) = open_shards(str(tmp_path), as_torch=False, expand_last=False, final="pre_norm")
    assert post["final_layer"] == "post_norm" and stored["final_layer"] == "pre_norm"
    np.testing.assert_array_equal(stored["last_hidden_state"], pre[keep])
    np.testing.assert_array_equal(post["last_hidden_state"], norm.apply_bits(pre[keep]))
    np.testing.assert_array_equal(post["aux_hidden_states"], aux)  # aux layers are never touched
    (as_torch,) = open_shards(str(tmp_path))
    assert as_torch["last_hidden_state"].shape == (t, 32)


def _as_format_2(path):
    """Rewrite a shard's metadata as format 2 wrote it: no final_layer key (the final layer was post-norm)."""
    import pyarrow.parquet as pq

    from pipeline.format.shards import META_KEY

    table = pq.read_table(path)
    meta = json.loads(table.schema.metadata[META_KEY])
    meta = {k: v for k, v in meta.items() if k != "final_layer"} | {"format_version": 2}
    pq.write_table(table.replace_schema_metadata({META_KEY: json.dumps(meta).encode()}), path)


@pytest.mark.parametrize("made_by", ["format 2", "final_layer=post_norm"])
def test_a_post_norm_output_refuses_a_pre_norm_read(tmp_path, made_by):
    """A format-2 output, or one extracted with extract.final_layer=post_norm: readable as before; the
    pre-norm state cannot be recovered from it, and asking for it says so."""
    rng = np.random.default_rng(3)
    layout = ShardLayout((1, 2), 32)
    last = random_bf16(rng, 4, 32)
    sample = encode_bits("a", [1, 2, 3, 4], [1] * 4, random_bf16(rng, 4, 64), last, layout)
    (rel,) = write_shard(Store(str(tmp_path)), [sample], layout)[:1]
    if made_by == "format 2":
        _as_format_2(tmp_path / rel)
    (s,) = open_shards(str(tmp_path), as_torch=False)
    assert s["final_layer"] == "post_norm"
    np.testing.assert_array_equal(s["last_hidden_state"], last)
    with pytest.raises(ValueError, match="cannot be recovered.*extract.final_layer=pre_norm"):
        next(open_shards(str(tmp_path), final="pre_norm"))
    with pytest.raises(ValueError, match="final="):
        next(open_shards(str(tmp_path), final="prenorm"))

"""bench_throughput --layers: the cut model computes exactly the full model's first layers, so a fast-server
benchmark on it measures the same server doing less work a token, not some other model."""

import json

import pytest
import torch
import transformers

from bench.bench_throughput import first_layers


def test_first_layers_are_the_full_models_first_layers(model_dir, tmp_path, text_ids):
    cut = first_layers(model_dir, 4, tmp_path / "cut")

    config = json.loads((cut / "config.json").read_text())
    assert config["num_hidden_layers"] == 4
    assert (cut / "tokenizer.json").is_file()

    full = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    short = transformers.AutoModelForCausalLM.from_pretrained(cut, dtype=torch.float32)
    ids = torch.tensor([text_ids[0]])
    with torch.no_grad():
        a = full(ids, output_hidden_states=True).hidden_states
        b = short(ids, output_hidden_states=True).hidden_states
    # hidden_states[0] is the embedding, [i] layer i's output; the cut model's last entry is after its norm.
    for i in range(4):
        torch.testing.assert_close(b[i], a[i], rtol=0, atol=0)
    assert not torch.equal(b[4], a[4])  # the norm, applied after layer 4 instead of layer 30


def test_first_layers_refuses_a_count_the_model_does_not_have(model_dir, tmp_path):
    with pytest.raises(SystemExit, match="--layers must be in 1.."):
        first_layers(model_dir, 10_000, tmp_path / "cut")

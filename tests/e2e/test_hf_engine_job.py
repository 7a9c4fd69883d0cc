"""The real job with `engine.name=hf` over the same input as the SGLang run: the same samples, errors and
tokens, and hidden states, like SGLang's, within bf16 noise of a float32 forward."""

from __future__ import annotations

import json

import numpy as np
import pytest

from pipeline.format.manifest import read_manifest
from pipeline.format.shards import open_shards
from pipeline.format.storage import Store

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def hf_run(ray_session, e2e_input, make_config, tmp_path_factory):
    from pipeline.driver.job import run

    out = tmp_path_factory.mktemp("harvest_hf") / "out"
    summary = run(make_config(e2e_input, out, **{"engine.name": "hf"}))
    return out, summary


def _samples(out) -> dict:
    return {s["sample_id"]: s for s in open_shards(str(out), as_torch=False)}


def _errors(out) -> set:
    rows = [
        json.loads(line) for f in sorted((out / "errors").glob("part-*.jsonl")) for line in f.read_text().splitlines()
    ]
    return {(e["sample_id"], e["stage"], e["reason"]) for e in rows}


def test_same_samples_errors_and_tokens_as_the_sglang_run(hf_run, harvest_run):
    (hf_out, hf_summary), (sg_out, sg_summary) = hf_run, harvest_run
    for key in ("input_rows", "samples", "samples_ok", "errors", "filtered", "tokens", "accounted"):
        assert hf_summary.totals[key] == sg_summary.totals[key], key
    hf, sg = _samples(hf_out), _samples(sg_out)
    assert set(hf) == set(sg) and len(hf) >= 16
    assert _errors(hf_out) == _errors(sg_out) and len(_errors(hf_out)) == 2
    for sid, s in sg.items():
        np.testing.assert_array_equal(hf[sid]["input_ids"], s["input_ids"])
        np.testing.assert_array_equal(hf[sid]["loss_mask"], s["loss_mask"])
        assert hf[sid]["aux_hidden_states"].shape == s["aux_hidden_states"].shape
        assert hf[sid]["last_hidden_state"].shape == s["last_hidden_state"].shape


def test_both_engines_store_states_within_bf16_noise(hf_run, harvest_run, references):
    """Every aux layer and the final state of every sample, hf and SGLang (both bf16), each judged against
    a float32 forward by the distance a bf16 forward of the same tokens has from it (the audit's rule)."""
    (hf_out, _), (sg_out, _) = hf_run, harvest_run
    layers = read_manifest(Store(str(sg_out)))["aux_layers"]
    hf, sg = _samples(hf_out), _samples(sg_out)
    worst = {}
    for engine, samples in (("hf", hf), ("sglang", sg)):
        for sid, s in samples.items():
            for d in references.check(
                f"{engine} {sid}", layers, s["input_ids"], s["aux_hidden_states"], s["last_hidden_state"]
            ):
                worst[engine] = max(worst.get(engine, 0.0), d.sample_ratio)
    print(f"\nworst sample/layer distance to float32, in units of a bf16 forward's: {worst}")


def test_manifest_records_the_hf_engine_and_the_output_verifies(hf_run, capsys):
    from pipeline.cli import main

    out, _ = hf_run
    manifest = read_manifest(Store(str(out)))
    engine = manifest["engine"]
    assert engine["name"] == "hf" and engine["dtype"] == "bfloat16" and engine["device"] == "cpu"
    import transformers

    assert engine["version"] == f"transformers {transformers.__version__}"
    assert manifest["status"] == "complete"
    # Where the actor's engine spent its time comes back with the results: every committed token ran.
    (actor,) = manifest["last_run"]["per_actor"].values()
    assert actor["engine"]["forwards"] > 0 and actor["engine"]["real_tokens"] >= manifest["totals"]["tokens"]
    assert actor["engine"]["padded_tokens"] >= actor["engine"]["real_tokens"] and actor["engine"]["forward_s"] > 0
    assert main(["verify", str(out)]) == 0
    assert "OK: every check holds" in capsys.readouterr().out

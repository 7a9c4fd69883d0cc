"""No misattribution under pressure: many samples of the same length, repeated content under other ids, two
actors with 32 requests in flight each. Proven against an independent computation: a transformers forward
of each sample (float32, with a bf16 one as the noise yardstick), never the capture path checking itself.

The fast version runs in the default suite; the full one (>= 1,000 samples) with `make test-stress`.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from pipeline.driver.job import run
from pipeline.format.manifest import read_manifest
from pipeline.format.shards import open_shards
from pipeline.format.storage import Store
from pipeline.tools.fidelity import DEFAULT_RULE, FINAL_DEPTH, as_float, upstream_noise
from pipeline.tools.verify import verify

pytestmark = pytest.mark.slow
LENGTHS = (16, 24, 32)  # few lengths: most samples share theirs with hundreds of others


def write_input(path, n: int) -> dict[str, list[int]]:
    rng = np.random.default_rng(n)
    samples: dict[str, list[int]] = {}
    for i in range(n):
        if i % 10 == 9:  # the same content as an earlier sample, under its own id
            samples[f"s{i}"] = samples[f"s{int(rng.integers(0, i - 1))}"]
        else:
            samples[f"s{i}"] = rng.integers(100, 49000, LENGTHS[i % len(LENGTHS)]).tolist()
    path.write_text("".join(json.dumps({"id": k, "input_ids": v}) + "\n" for k, v in samples.items()))
    return samples


def final_state_verdict(got, truth_blocks, yard_blocks, layers):
    """The stored final state against one sample's reference, its tokens allowed the noise they carry up
    from the aux layers (the audit's rule)."""
    upstream = upstream_noise(truth_blocks, yard_blocks, [*layers, FINAL_DEPTH])[-1]
    return DEFAULT_RULE.judge(got, truth_blocks[-1], yard_blocks[-1], upstream)


@pytest.mark.parametrize("n", [pytest.param(128, id="fast"), pytest.param(1200, id="full", marks=pytest.mark.stress)])
def test_no_sample_is_stored_with_another_samples_states(n, ray_session, make_config, references, tmp_path):
    samples = write_input(tmp_path / "stress.jsonl", n)
    out = tmp_path / "out"
    cfg = make_config(
        tmp_path / "stress.jsonl",
        out,
        **{
            "engine.num_actors": 2,
            "engine.max_in_flight": 32,
            "engine.cpus_per_actor": 0.5,
            "extract.batch_size": 64,
            # Two servers start at once on two cores (~1-2 minutes); one that stalls is started again after
            # this (actors/sglang/engine.py), well inside the suite's time.
            "engine.startup_timeout_s": 300,
        },
    )
    summary = run(cfg)
    assert summary.totals["samples_ok"] == n and summary.totals["errors"] == 0
    assert verify(str(out)).ok
    stored = {s["sample_id"]: s for s in open_shards(str(out), as_torch=False)}
    assert len(stored) == n
    assert len(list((out / "shards").iterdir())) >= 2
    layers = read_manifest(Store(str(out)))["aux_layers"]
    keys = list(samples)
    ref = dict(zip(keys, references.layers(layers, [samples[k] for k in keys])))  # (truth, yardstick) blocks
    wrong = []
    for sid, s in stored.items():
        assert s["input_ids"].tolist() == samples[sid]
        got = as_float(s["last_hidden_state"])
        own = final_state_verdict(got, *ref[sid], layers)
        # Every other sample of the same length with different content: a swap would look like one of them,
        # so each must fail the rule that the sample's own forward passes.
        others = [k for k in samples if len(samples[k]) == len(samples[sid]) and samples[k] != samples[sid]]
        rivals = [k for k in others if final_state_verdict(got, *ref[k], layers).passed]
        if not own.passed or rivals:
            wrong.append((sid, own.why(), rivals[:3]))
    print(f"{n} samples, 2 actors x 32 in flight: {len(wrong)} stored with another sample's states")
    assert not wrong, wrong[:5]

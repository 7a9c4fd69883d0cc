"""Every family users train drafts for, as a new user tries it: a tiny random-init model built from transformers'
own config class (tests/families.py: 8 layers, hidden 256, the family's quirks on), 8 pre-tokenized prompts, the
default config plus `model.path` and `engine.name`, the real job, then `harvest audit --samples all`; and the
audit's rule, with the same reference, failing that output's samples damaged four ways.

Which pairs run is the support table's (pipeline/driver/support.py): every pair it marks as checked here runs in
`make test-long`; the pairs it marks for the suite run in `make test` too. A pair the table marks as unable to
run is refused before the run, naming the family and the engines (test below).
"""

from __future__ import annotations

import pytest

from families import make_model, prompt_lines
from pipeline.driver.support import CHECKED_HERE, SUPPORT
from tests_support import damaged_samples_fail

pytestmark = pytest.mark.slow


def _pairs():
    out = []
    for (family, engine, device), entry in sorted(SUPPORT.items()):
        if device != "cpu" or entry.status != CHECKED_HERE:
            continue
        marks = [] if entry.in_suite else [pytest.mark.long]
        out.append(pytest.param(family, engine, id=f"{family}-{engine}", marks=marks))
    return out


@pytest.fixture(scope="session")
def family_models(tmp_path_factory, model_dir):
    built: dict[tuple, object] = {}

    def get(family: str, **overrides):
        key = (family, tuple(sorted(overrides.items())))
        if key not in built:
            built[key] = make_model(family, tmp_path_factory.mktemp(f"model-{family}"), model_dir, **overrides)
        return built[key]

    return get


@pytest.fixture(scope="session")
def family_input(tmp_path_factory, model_dir):
    path = tmp_path_factory.mktemp("family-input") / "prompts.jsonl"
    path.write_text("\n".join(prompt_lines(model_dir)) + "\n")
    return path


# The model a pair runs (pipeline/driver/support.py says why): SGLang's Mistral class has no sliding window, so
# it runs Mistral as the later checkpoints ship it (sliding_window null); the window of tests/families.py (64)
# runs on the hf engine, and is refused on SGLang (the test below).
PAIR_MODEL = {("mistral", "sglang"): {"sliding_window": None}}


def test_a_model_class_without_the_models_sliding_window_is_refused_before_the_run(
    family_models, make_config, tmp_path
):
    from pipeline.driver.plan import PlanError, make_plan

    cfg = make_config(tmp_path / "in.jsonl", tmp_path / "out", **{"model.path": str(family_models("mistral"))})
    with pytest.raises(PlanError, match=r"sliding_window=64 cannot run on engine sglang with extract.max_tokens=2048"):
        make_plan(cfg, gpus_available=0)


@pytest.mark.parametrize("family,engine", _pairs())
def test_a_family_runs_through_the_job_and_passes_the_audit(
    family, engine, family_models, family_input, ray_session, make_config, tmp_path
):
    from pipeline.driver.job import run
    from pipeline.format.manifest import read_manifest
    from pipeline.format.storage import Store
    from pipeline.tools.audit import audit

    out = tmp_path / "out"
    model = family_models(family, **PAIR_MODEL.get((family, engine), {}))
    summary = run(make_config(family_input, out, **{"model.path": str(model), "engine.name": engine}))
    t = summary.totals
    assert t["samples_ok"] == t["input_rows"] == 8 and t["errors"] == 0, t
    manifest = read_manifest(Store(str(out)))
    assert manifest["support"]["status"] == CHECKED_HERE, manifest["support"]
    report = audit(str(out), samples=None)
    print(report.text())
    assert report.ok, report.text()
    ties = sum(d["routing_near_tie_tokens"] for d in report.per_layer().values())
    print(f"tokens at MoE routing near ties, over the stored layers: {ties}")
    caught, routers = damaged_samples_fail(out)
    assert bool(routers) == (family in MOE), routers  # every MoE layer's router found, none in a dense model
    print(f"damage caught per kind over {t['samples_ok']} samples: {caught}")


MOE = {"qwen3_moe", "deepseek_v3", "gpt_oss"}

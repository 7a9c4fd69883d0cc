"""Every family users train drafts for, as a new user tries it: a tiny random-init model built from transformers'
own config class (tests/families.py: 8 layers, hidden 256, the family's quirks on), 8 pre-tokenized prompts, the
default config plus `model.path` and `engine.name`, the real job, then `harvest audit --samples all`.

Which pairs run is the support table's (pipeline/driver/support.py): every pair it marks as checked here runs in
`make test-long`; the pairs it marks for the suite run in `make test` too. A pair the table marks as unable to
run is refused before the run, naming the family and the engines (test below).
"""

from __future__ import annotations

import pytest

from families import make_model, prompt_lines
from pipeline.driver.support import CHECKED_HERE, SUPPORT

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
    built: dict[str, object] = {}

    def get(family: str):
        if family not in built:
            built[family] = make_model(family, tmp_path_factory.mktemp(f"model-{family}"), model_dir)
        return built[family]

    return get


@pytest.fixture(scope="session")
def family_input(tmp_path_factory, model_dir):
    path = tmp_path_factory.mktemp("family-input") / "prompts.jsonl"
    path.write_text("\n".join(prompt_lines(model_dir)) + "\n")
    return path


@pytest.mark.parametrize("family,engine", _pairs())
def test_a_family_runs_through_the_job_and_passes_the_audit(
    family, engine, family_models, family_input, ray_session, make_config, tmp_path
):
    from pipeline.driver.job import run
    from pipeline.format.manifest import read_manifest
    from pipeline.format.storage import Store
    from pipeline.tools.audit import audit

    out = tmp_path / "out"
    summary = run(make_config(family_input, out, **{"model.path": str(family_models(family)), "engine.name": engine}))
    t = summary.totals
    assert t["samples_ok"] == t["input_rows"] == 8 and t["errors"] == 0, t
    manifest = read_manifest(Store(str(out)))
    assert manifest["support"]["status"] == CHECKED_HERE, manifest["support"]
    report = audit(str(out), samples=None)
    print(report.text())
    assert report.ok, report.text()

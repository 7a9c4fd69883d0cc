"""The support table (pipeline/driver/support.py): the README shows it as it is, the plan refuses what cannot
run before the run, and what nobody checked is said, not hidden."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pipeline.driver import support

README = Path(__file__).resolve().parents[4] / "README.md"


def test_the_readme_table_is_the_one_the_job_reads():
    text = README.read_text()
    start, end = "<!-- support table: pipeline/driver/support.py -->", "<!-- end of support table -->"
    assert start in text and end in text
    shown = text.split(start, 1)[1].split(end, 1)[0].strip()
    assert shown == support.table_markdown(), "README's support table differs: paste support.table_markdown()"


def test_every_checked_pair_names_a_family_of_the_table_and_a_real_engine():
    for family, engine, device in support.SUPPORT:
        assert family in support.FAMILY_NAMES and engine in support.ENGINES and device in support.DEVICES


def test_a_pair_that_cannot_run_is_refused_naming_the_family_and_the_engine_that_runs_it(monkeypatch):
    table = dict(support.SUPPORT)
    table[("gpt_oss", "sglang", "cpu")] = support.Entry(support.CANNOT, "no CPU attention backend for its sinks")
    table[("gpt_oss", "hf", "cpu")] = support.Entry(support.CHECKED_HERE)
    monkeypatch.setattr(support, "SUPPORT", table)
    with pytest.raises(support.Unsupported) as e:
        support.check("gpt_oss", "sglang", "cpu")
    msg = str(e.value)
    assert "gpt-oss (gpt_oss) cannot run on engine sglang on cpu: no CPU attention backend" in msg
    assert "try engine.name=hf (hf (checked here))" in msg
    assert support.check("gpt_oss", "hf", "cpu")["status"] == support.CHECKED_HERE


def test_an_unlisted_pair_is_not_checked_and_the_family_comes_from_the_text_config(tmp_path):
    assert support.check("some_new_family", "sglang", "cpu")["status"] == support.NOT_CHECKED
    (tmp_path / "config.json").write_text(
        json.dumps({"model_type": "gemma3", "text_config": {"model_type": "gemma3_text"}})
    )
    from pipeline.intake.model import model_type

    assert model_type(tmp_path) == "gemma3_text"


def test_a_model_class_without_sliding_windows_runs_only_where_no_sample_exceeds_the_window(tmp_path):
    from pipeline.intake.model import sliding_window

    support.check_window("mistral", "sglang", None, 8192)  # full attention: nothing to ignore
    support.check_window("mistral", "sglang", 4096, 4096)  # no sample can be longer than the window
    support.check_window("mistral", "hf", 64, 2048)  # transformers applies it
    with pytest.raises(support.Unsupported) as e:
        support.check_window("mistral", "sglang", 64, 2048)
    msg = str(e.value)
    assert "Mistral (mistral) with sliding_window=64 cannot run on engine sglang with extract.max_tokens=2048" in msg
    assert "set extract.max_tokens <= 64 or engine.name=hf" in msg
    for config, want in [
        ({"model_type": "mistral", "sliding_window": 4096}, 4096),
        ({"model_type": "mistral", "sliding_window": None}, None),
        ({"model_type": "qwen3", "sliding_window": 4096, "use_sliding_window": False}, None),
        ({"model_type": "x", "text_config": {"sliding_window": 512}}, 512),
    ]:
        (tmp_path / "config.json").write_text(json.dumps(config))
        assert sliding_window(tmp_path) == want, config

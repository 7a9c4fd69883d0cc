import re

import pyarrow as pa
import pytest

from pipeline.driver.job import conversation_summary, find_duplicates
from pipeline.driver.plan import default_aux_layers, make_plan


def test_default_aux_layers():
    # HF hidden_states[2, L//2, L-3]: SGLang's EAGLE-3 default, SpecForge's and speculators'.
    assert default_aux_layers(30) == (1, 14, 26)
    assert default_aux_layers(32) == (1, 15, 28)
    assert default_aux_layers(36) == (1, 17, 32)


# The families users train EAGLE-3 drafts for, by SGLang model module and class.
SGLANG_EAGLE3_CLASSES = [
    ("llama", "LlamaForCausalLM"),
    ("qwen2", "Qwen2ForCausalLM"),
    ("qwen3", "Qwen3ForCausalLM"),
    ("qwen3_moe", "Qwen3MoeForCausalLM"),
    ("deepseek_v2", "DeepseekV2ForCausalLM"),  # DeepSeek-V3 and Kimi-K2 run on this class
    ("gpt_oss", "GptOssForCausalLM"),
    ("gemma3_causal", "Gemma3ForCausalLM"),
]


@pytest.mark.parametrize("module,cls_name", SGLANG_EAGLE3_CLASSES)
@pytest.mark.parametrize("layers", [8, 30, 36, 61])
def test_default_aux_layers_are_sglangs_own_eagle3_default(module, cls_name, layers):
    """Our default ids, given to SGLang, capture what SGLang's EAGLE-3 serving captures when no ids are given:
    its own code decides (`set_eagle3_layers_to_capture`, which shifts given ids by one), run on a stand-in
    for the model object it configures."""
    import importlib
    import types

    cls = getattr(importlib.import_module(f"sglang.srt.models.{module}"), cls_name)

    class Inner:  # some classes set the list on their inner model, others ask it to
        def set_eagle3_layers_to_capture(self, ids):
            self.layers_to_capture = list(ids)

    def captured(layer_ids):
        model = types.SimpleNamespace(
            pp_group=types.SimpleNamespace(is_last_rank=True),
            config=types.SimpleNamespace(num_hidden_layers=layers),
            model=Inner(),
        )
        cls.set_eagle3_layers_to_capture(model, layer_ids)
        assert model.capture_aux_hidden_states
        return list(model.model.layers_to_capture)

    assert captured(list(default_aux_layers(layers))) == captured(None)


def table(rows):
    return pa.table({"sample_id": [r[0] for r in rows], "source": [r[1] for r in rows]})


def test_no_duplicates():
    assert find_duplicates(table([("a", "f:1"), ("b", "f:2")])) == {}


def test_first_by_file_and_numeric_line_is_kept():
    rows = [("x", "data/a.jsonl:10"), ("x", "data/a.jsonl:9"), ("y", "data/a.jsonl:2"), ("x", "data/b.jsonl:1")]
    dups = find_duplicates(table(rows))
    assert dups == {
        "data/a.jsonl:10": "duplicate sample_id 'x' (first seen at data/a.jsonl:9)",
        "data/b.jsonl:1": "duplicate sample_id 'x' (first seen at data/a.jsonl:9)",
    }


def test_line_100_comes_after_line_20_across_urls():
    rows = [("k", "s3://bucket/p/f.jsonl:100"), ("k", "s3://bucket/p/f.jsonl:20"), ("k", "s3://bucket/p/f.jsonl:3")]
    dups = find_duplicates(table(rows))
    assert set(dups) == {"s3://bucket/p/f.jsonl:100", "s3://bucket/p/f.jsonl:20"}
    assert all(r.endswith("(first seen at s3://bucket/p/f.jsonl:3)") for r in dups.values())


def test_result_does_not_depend_on_input_order():
    rows = [("a", f"f:{i}") for i in (12, 3, 7, 100)] + [("b", "f:1"), ("b", "e:50")]
    forward = find_duplicates(table(rows))
    assert forward == find_duplicates(table(rows[::-1]))
    assert set(forward) == {"f:7", "f:12", "f:100", "f:1"}


def test_turns_of_one_row_are_not_duplicates_of_each_other():
    rows = [("c#0", "f:1"), ("c#1", "f:1"), ("c#2", "f:1"), ("d", "f:2")]
    assert find_duplicates(table(rows)) == {}


def test_a_repeated_multi_turn_row_is_one_duplicate_source():
    rows = [("c#0", "f:1"), ("c#1", "f:1"), ("c#0", "f:5"), ("c#1", "f:5")]
    assert find_duplicates(table(rows)) == {"f:5": "duplicate sample_id 'c#0' (first seen at f:1)"}


def index(rows):
    cols = ("source", "turns", "cost_full", "cost_each", "unrendered")
    return pa.table({c: [r[i] for r in rows] for i, c in enumerate(cols)})


def test_conversation_summary_counts_rows_once_and_prices_both_policies():
    rows = [
        ("f:1", "full", 100, 180, ""),  # one sample
        ("f:2", "each", 50, 120, "messages[2].reasoning_content"),  # two samples of one row
        ("f:2", "each", 50, 120, ""),
        ("f:3", "", 0, 0, ""),  # a pre-tokenized or text row
        ("f:4", "full", 30, 30, "messages[1].reasoning_content,tools"),
    ]
    s = conversation_summary(index(rows), "auto")
    assert (s["conversations"], s["full"], s["each"]) == (3, 2, 1)
    assert (s["tokens_full"], s["tokens_each"], s["tokens_chosen"]) == (180, 330, 100 + 120 + 30)
    assert s["unrendered"] == {"reasoning_content": 2, "tools": 1}
    assert "extract.turns=auto" in s["plan"] and "tokens 250 (full would be 180, each 330)" in s["plan"]


def test_turns_policy_and_template_kwargs_are_data_settings(repo_root):
    from conf import load_config

    base = load_config(repo_root / "conf" / "default.yaml")
    other = load_config(
        repo_root / "conf" / "default.yaml", ["extract.turns=each", "extract.template_kwargs={enable_thinking: false}"]
    )
    a, b = make_plan(base, 0).settings, make_plan(other, 0).settings
    assert (a["turns"], a["template_kwargs"]) == ("auto", {})
    assert (b["turns"], b["template_kwargs"]) == ("each", {"enable_thinking": False})


@pytest.mark.parametrize("layers", [6, 5, 4, 3, 1])  # collide (6, 5, 4) or go below layer 0 (3, 1)
def test_default_aux_layers_that_do_not_fit_a_small_model_are_refused_before_the_run(repo_root, monkeypatch, layers):
    from conf import load_config
    from pipeline.driver import plan
    from pipeline.intake import model

    monkeypatch.setattr(model, "num_hidden_layers", lambda _: layers)
    with pytest.raises(
        plan.PlanError,
        match=rf"the default aux layers \[.*\] do not fit a model of {layers} layers .*set extract.aux_layers",
    ):
        make_plan(load_config(repo_root / "conf" / "default.yaml"), 0)
    monkeypatch.setattr(model, "num_hidden_layers", lambda _: 7)  # the smallest the default fits
    assert make_plan(load_config(repo_root / "conf" / "default.yaml"), 0).settings["aux_layers"] == [1, 2, 3]


def test_aux_layers_beyond_the_model_are_refused_before_the_run(repo_root):
    from conf import load_config
    from pipeline.driver.plan import PlanError

    with pytest.raises(PlanError, match=re.escape("extract.aux_layers [2, 30]: the model has layers 0..29")):
        make_plan(load_config(repo_root / "conf" / "default.yaml", ["extract.aux_layers=[2, 30]"]), 0)


def test_a_family_the_engine_cannot_run_is_refused_before_its_weights_are_read(repo_root, tmp_path):
    """gpt-oss on SGLang's CPU mode (pipeline/driver/support.py): the plan names the family, why, and the
    engine that runs it; only config.json is read (this model directory has no weights at all)."""
    import json

    from conf import load_config
    from pipeline.driver.plan import PlanError

    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt_oss", "num_hidden_layers": 8}))
    cfg = load_config(repo_root / "conf" / "default.yaml", [f"model.path={tmp_path}", "engine.device=cpu"])
    with pytest.raises(PlanError) as e:
        make_plan(cfg, 0)
    msg = str(e.value)
    assert msg.startswith("gpt-oss (gpt_oss) cannot run on engine sglang on cpu: SGLang 0.5.23 runs gpt-oss only")
    assert "try engine.name=hf" in msg


def test_rays_timeout_for_starting_actors_names_the_setting_and_the_wait():
    """Ray blames the cluster's resources; the run's one line names the engine's start-up setting instead."""
    import ray

    from pipeline.driver.failures import failure_message
    from pipeline.driver.job import EngineStartTimeout, _batches_once_engines_start

    class Results:
        def __init__(self, error):
            self.error = error

        def iter_batches(self, **_):
            raise self.error
            yield  # a generator, like Ray Data's

    start = ray.exceptions.GetTimeoutError("Timed out while starting actors. This may mean that the cluster ...")
    with pytest.raises(EngineStartTimeout) as e:
        list(_batches_once_engines_start(Results(start), 1260, 2, 600.0))
    line = failure_message(e.value)
    assert "after 1260 s" in line and "engine.startup_timeout_s=600" in line and "2 start attempt" in line
    # Any other timeout is not the engines' start and passes through as it is.
    other = ray.exceptions.GetTimeoutError("Get timed out: some object")
    with pytest.raises(ray.exceptions.GetTimeoutError):
        list(_batches_once_engines_start(Results(other), 1260, 2, 600.0))


def test_the_rows_still_to_do_are_those_neither_committed_nor_a_duplicates(ray_session):
    import ray.data

    from pipeline.driver.job import _still_to_do

    rows = [{"source": f"f:{i // 2}", "sample_id": f"s{i}"} for i in range(10)]  # two turns a source line
    ds = ray.data.from_items(rows)

    def ids(d):
        return sorted(r["sample_id"] for r in d.take_all())

    assert _still_to_do(ds, set(), set()) is ds  # a fresh output: no filter at all
    assert ids(_still_to_do(ds, {"f:1"}, set())) == ["s0", "s1", "s4", "s5", "s6", "s7", "s8", "s9"]
    assert ids(_still_to_do(ds, set(), {"s0", "s9"})) == ["s1", "s2", "s3", "s4", "s5", "s6", "s7", "s8"]
    assert ids(_still_to_do(ds, {"f:1", "f:4"}, {"s0"})) == ["s1", "s4", "s5", "s6", "s7"]

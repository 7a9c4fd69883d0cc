import re

import pytest

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


def test_the_row_group_size_is_an_output_setting_in_mb(repo_root):
    """output.row_group_mb reaches the extractor in bytes (64 MB unless set)."""
    import types

    from conf import load_config
    from pipeline.driver.job import extractor_kwargs
    from pipeline.format.shards import ROW_GROUP_BYTES, ShardLayout

    plan = types.SimpleNamespace(model_dir="m", cuda=False, layout=ShardLayout((1, 2), 8))
    for overrides, expected in (([], ROW_GROUP_BYTES), (["output.row_group_mb=16"], 16 << 20)):
        cfg = load_config(repo_root / "conf" / "default.yaml", overrides)
        assert extractor_kwargs(cfg, plan)["row_group_bytes"] == expected
    assert ROW_GROUP_BYTES == 64 << 20
    with pytest.raises(Exception, match="row_group_mb"):
        load_config(repo_root / "conf" / "default.yaml", ["output.row_group_mb=0"])

import pydantic
import pytest
import yaml

from conf import ConfigError, HarvestConfig, load_config


@pytest.fixture
def default_yaml(repo_root):
    return repo_root / "conf" / "default.yaml"


def write_yaml(tmp_path, tree) -> str:
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(tree))
    return str(path)


def test_default_yaml_loads(default_yaml):
    cfg = load_config(default_yaml)
    assert isinstance(cfg, HarvestConfig)
    assert cfg.input.path == "conf/data/sample_conversations.jsonl"
    assert cfg.output.path == "out/default"
    assert cfg.model.path == "default"
    assert cfg.extract.aux_layers is None
    assert cfg.extract.overlength == "reject"
    assert cfg.engine.server_flags == ()


@pytest.mark.parametrize(
    "tree, dotted",
    [
        ({"inputs": {"path": "x"}}, "inputs"),
        ({"engine": {"tp_sise": 2}}, "engine.tp_sise"),
        ({"extract": {"max_token": 10}}, "extract.max_token"),
        ({"output": {"path": "o", "compression": "zstd"}}, "output.compression"),
    ],
)
def test_unknown_key_is_named_in_error(tmp_path, tree, dotted):
    base = {"input": {"path": "in.jsonl"}, "output": {"path": "out"}}
    for section, values in tree.items():
        base[section] = {**base.get(section, {}), **values}
    with pytest.raises(ConfigError) as exc:
        load_config(write_yaml(tmp_path, base))
    assert f"{dotted}: unknown key" in str(exc.value)


def test_missing_output_path_is_required(tmp_path):
    path = write_yaml(tmp_path, {"input": {"path": "in.jsonl"}, "output": {"encoding": "planes_zstd"}})
    with pytest.raises(ConfigError, match=r"output\.path: required"):
        load_config(path)


def test_missing_output_section_is_required():
    with pytest.raises(ConfigError, match=r"output: required"):
        load_config(None, ["input.path=in.jsonl"])


def test_missing_file_is_config_error(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "nope.yaml")


def test_top_level_must_be_mapping(tmp_path):
    path = tmp_path / "list.yaml"
    path.write_text("- a\n- b\n")
    with pytest.raises(ConfigError, match="mapping"):
        load_config(path)


def test_set_overrides_are_parsed_as_yaml(default_yaml):
    cfg = load_config(default_yaml, ["extract.max_tokens=128", "engine.server_flags=[--foo, --bar=1]"])
    assert cfg.extract.max_tokens == 128
    assert cfg.engine.server_flags == ("--foo", "--bar=1")
    # Untouched values keep the file's setting.
    assert cfg.extract.overlength == "reject" and cfg.engine.num_actors == 1


def test_set_can_supply_required_fields_without_file():
    cfg = load_config(None, ["input.path=a.jsonl", "output.path=s3://b/p", "extract.aux_layers=[1, 4]"])
    assert cfg.output.path == "s3://b/p"
    assert cfg.extract.aux_layers == (1, 4)


def test_set_nested_new_key_is_rejected(default_yaml):
    with pytest.raises(ConfigError, match=r"engine\.new: unknown key"):
        load_config(default_yaml, ["engine.new.key=1"])


def test_set_below_a_scalar_is_rejected(default_yaml):
    with pytest.raises(ConfigError, match="max_tokens is not a section"):
        load_config(default_yaml, ["extract.max_tokens.deeper=1"])


@pytest.mark.parametrize("item", ["extract.max_tokens", "=3"])
def test_set_without_key_value_is_rejected(default_yaml, item):
    with pytest.raises(ConfigError, match="expected section.key=value"):
        load_config(default_yaml, [item])


@pytest.mark.parametrize(
    "override, where",
    [
        ("engine.tp_size=0", "engine.tp_size"),
        ("engine.num_actors=0", "engine.num_actors"),
        ("extract.aux_layers=[2, 2, 5]", "extract.aux_layers"),
        ("extract.aux_layers=[]", "extract.aux_layers"),
        ("extract.aux_layers=[-1, 3]", "extract.aux_layers"),
        ("extract.overlength=drop", "extract.overlength"),
        ("output.zstd_level=23", "output.zstd_level"),
        ("engine.device=tpu", "engine.device"),
    ],
)
def test_invalid_values_are_rejected(default_yaml, override, where):
    with pytest.raises(ConfigError) as exc:
        load_config(default_yaml, [override])
    assert f"  {where}:" in str(exc.value)


def test_tp_size_above_one_needs_gpus(default_yaml):
    with pytest.raises(ConfigError, match="needs GPUs"):
        load_config(default_yaml, ["engine.device=cpu", "engine.tp_size=2"])
    assert load_config(default_yaml, ["engine.device=cuda", "engine.tp_size=2"]).engine.gpus_per_actor(True) == 2


def test_gpus_per_actor_is_zero_without_cuda(default_yaml):
    cfg = load_config(default_yaml, ["engine.tp_size=4"])
    assert cfg.engine.gpus_per_actor(cuda=False) == 0
    assert cfg.engine.gpus_per_actor(cuda=True) == 4


def test_config_objects_are_frozen(default_yaml):
    cfg = load_config(default_yaml)
    with pytest.raises(pydantic.ValidationError):
        cfg.extract.max_tokens = 1
    with pytest.raises(pydantic.ValidationError):
        cfg.output = cfg.output
    assert cfg.extract.max_tokens == 2048


def test_extract_turns_and_template_kwargs(default_yaml):
    cfg = load_config(default_yaml)
    assert (cfg.extract.turns, cfg.extract.template_kwargs) == ("auto", {})
    cfg = load_config(default_yaml, ["extract.turns=each", "extract.template_kwargs={enable_thinking: true}"])
    assert (cfg.extract.turns, cfg.extract.template_kwargs) == ("each", {"enable_thinking": True})
    with pytest.raises(ConfigError, match="extract.turns"):
        load_config(default_yaml, ["extract.turns=last"])
    with pytest.raises(ConfigError, match="extract.template_kwargs"):
        load_config(default_yaml, ["extract.template_kwargs=[1]"])
    with pytest.raises(ConfigError, match="may not set \\['add_generation_prompt'\\]"):
        load_config(default_yaml, ["extract.template_kwargs={add_generation_prompt: true}"])


def test_each_engine_has_its_own_knobs_and_defaults(default_yaml):
    sglang = load_config(default_yaml)
    assert sglang.engine.name == "sglang" and sglang.engine.max_in_flight == 16
    assert (sglang.engine.batches(False), sglang.batch_size(False)) == (2, 32)
    hf = load_config(default_yaml, ["engine.name=hf"])  # the default config runs on the hf engine as is
    assert hf.engine.max_batch_tokens == 16384 and not hasattr(hf.engine, "max_in_flight")
    # The measured best on a GPU without further flags; the CPU keeps small batches.
    assert (hf.engine.batches(True), hf.batch_size(True)) == (16, 128)
    assert (hf.engine.batches(False), hf.batch_size(False)) == (2, 32)
    # What the user sets wins over the engine's defaults.
    mine = load_config(default_yaml, ["engine.name=hf", "engine.batches_per_actor=3", "extract.batch_size=7"])
    assert (mine.engine.batches(True), mine.batch_size(True)) == (3, 7)
    # A section that names no engine is SGLang's.
    assert load_config(None, ["input.path=a", "output.path=b", "engine.num_actors=2"]).engine.name == "sglang"


def test_a_knob_of_another_engine_is_refused_with_its_owner(default_yaml):
    with pytest.raises(
        ConfigError,
        match=r"engine\.max_in_flight: not a setting of engine.name=hf \(it belongs to engine.name=sglang\)",
    ):
        load_config(default_yaml, ["engine.name=hf", "engine.max_in_flight=4"])
    with pytest.raises(
        ConfigError,
        match=r"engine\.max_batch_tokens: not a setting of engine.name=sglang \(it belongs to engine.name=hf\)",
    ):
        load_config(default_yaml, ["engine.max_batch_tokens=4096"])
    with pytest.raises(ConfigError, match=r"engine\.name must be one of \['hf', 'sglang'\]"):
        load_config(default_yaml, ["engine.name=vllm"])
    with pytest.raises(ConfigError, match="tp_size must be 1"):
        load_config(default_yaml, ["engine.name=hf", "engine.device=cuda", "engine.tp_size=2"])


def test_generate_section_is_typed_and_stands_in_for_output():
    cfg = load_config(None, ["input.path=in.jsonl", "generate.output=regen", "generate.policy=each"])
    assert cfg.output is None and cfg.generate.policy == "each" and cfg.generate.max_in_flight == 48
    assert cfg.generate.sampling()["temperature"] == 0.0
    with pytest.raises(ConfigError, match=r"generate\.policy"):
        load_config(None, ["input.path=x", "generate.output=r", "generate.policy=first"])
    with pytest.raises(ConfigError, match=r"generate\.top_p"):
        load_config(None, ["input.path=x", "generate.output=r", "generate.top_p=0"])
    with pytest.raises(ConfigError, match=r"generate\.output: required"):
        load_config(None, ["input.path=x", "generate.policy=last"])
    with pytest.raises(ConfigError, match="must differ"):
        load_config(None, ["input.path=x", "generate.output=same", "output.path=same"])


def test_the_debug_section_holds_the_profiling_switches(default_yaml):
    """debug: off, or the engine's own default, unless set; any engine's config takes it (the sglang engine
    reads none of it)."""
    cfg = load_config(default_yaml)
    assert cfg.debug.model_dump() == {
        "forward_log": None,
        "pinned_slabs": None,
        "cudnn_attention": "warm",
        "fill_floor": None,
    }
    sets = ["debug.forward_log=/logs", "debug.pinned_slabs=0", "debug.cudnn_attention=always", "debug.fill_floor=0.5"]
    for engine in ("hf", "sglang"):
        cfg = load_config(default_yaml, [f"engine.name={engine}", *sets])
        assert (cfg.debug.forward_log, cfg.debug.pinned_slabs, cfg.debug.cudnn_attention) == ("/logs", 0, "always")
        assert cfg.debug.fill_floor == 0.5
    assert load_config(default_yaml, ["debug.fill_floor=measured"]).debug.fill_floor == "measured"
    for bad in ("debug.pinned_slabs=-1", "debug.fill_floor=0", "debug.cudnn_attention=never", "debug.verbose=1"):
        with pytest.raises(ConfigError, match=rf"  debug\.{bad.split('.')[1].split('=')[0]}:"):
            load_config(default_yaml, [bad])


@pytest.mark.parametrize("key, value", [("fill_floor", "0.5"), ("cudnn_attention", "always")])
@pytest.mark.parametrize("engine", ["hf", "sglang"])
def test_a_debug_switch_set_under_engine_is_refused_with_its_place(default_yaml, key, value, engine):
    with pytest.raises(ConfigError, match=rf"engine\.{key}: not a setting of engine \(it belongs to debug\.{key}\)"):
        load_config(default_yaml, [f"engine.name={engine}", f"engine.{key}={value}"])

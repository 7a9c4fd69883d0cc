import json

import pytest

from conf import load_config
from pipeline.driver.preflight import PreflightError, check_gpus, lock_output, plan_or_refuse
from pipeline.format.storage import Store


def cfg(tmp_path, *sets):
    return load_config("conf/default.yaml", [f"output.path={tmp_path / 'out'}", *sets])


def test_a_missing_model_dir_is_refused(tmp_path):
    with pytest.raises(PreflightError, match=r"model.path .*nope.* is not a HF model directory \(no config.json\)"):
        plan_or_refuse(cfg(tmp_path, f"model.path={tmp_path / 'nope'}"), 0)


def test_an_unreadable_model_config_is_refused(tmp_path):
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text(json.dumps({"hidden_size": 8}))
    with pytest.raises(PreflightError, match="num_hidden_layers"):
        plan_or_refuse(cfg(tmp_path, f"model.path={tmp_path / 'm'}"), 0)


def test_an_aux_layer_the_model_does_not_have_is_refused(tmp_path, model_dir):
    with pytest.raises(PreflightError, match=r"aux_layers \[2, 99\]: the model has layers 0..29"):
        plan_or_refuse(cfg(tmp_path, "extract.aux_layers=[2, 99]"), 0)


def test_tp_size_larger_than_any_node_is_refused(tmp_path):
    c = cfg(tmp_path, "engine.device=cuda", "engine.tp_size=4")
    with pytest.raises(
        PreflightError, match="engine.tp_size=4 needs 4 GPUs on one node, but the largest node .* has 2"
    ):
        check_gpus(c, cuda=True, gpus_per_node=[2.0, 2.0])
    check_gpus(c, cuda=True, gpus_per_node=[2.0, 8.0])
    check_gpus(cfg(tmp_path), cuda=False, gpus_per_node=[])


def test_an_output_that_cannot_be_written_is_refused(tmp_path):
    (tmp_path / "a-file").write_text("x")
    with pytest.raises(PreflightError, match="output.path .*a-file/out cannot be written: NotADirectoryError"):
        lock_output(Store(str(tmp_path / "a-file" / "out")))

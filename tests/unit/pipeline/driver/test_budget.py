import pytest

from pipeline.driver import budget
from pipeline.driver.budget import InsufficientSpace, check_budget, estimate_bytes
from pipeline.format.shards import ShardLayout
from pipeline.format.storage import Store


def test_estimate_is_tokens_times_layers_times_hidden_times_two_times_ratio():
    layout = ShardLayout((2, 15, 27), 576)
    assert estimate_bytes(layout, 1000, 400) == int(1000 * 4 * 576 * 2 * 0.71)


def test_masked_final_layer_counts_only_masked_tokens():
    layout = ShardLayout((2, 15, 27), 576, last_rows="masked")
    assert estimate_bytes(layout, 1000, 400) == int((1000 * 3 + 400) * 576 * 2 * 0.71)


def test_refuses_when_the_estimate_exceeds_free_space(tmp_path, monkeypatch):
    monkeypatch.setattr(budget, "free_bytes", lambda store: 10_000)
    layout = ShardLayout((2, 15, 27), 576)
    with pytest.raises(InsufficientSpace, match="check_free_space=false"):
        check_budget(Store(str(tmp_path / "out")), layout, tokens=1000, masked_tokens=1000, enforce=True)
    assert check_budget(Store(str(tmp_path / "out")), layout, 1000, 1000, enforce=False) > 10_000


def test_free_space_of_a_missing_local_output_is_read_from_its_parent(tmp_path):
    assert budget.free_bytes(Store(str(tmp_path / "a" / "b"))) > 0

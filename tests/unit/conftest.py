"""Shared unit fixtures: the default model's tokenizer is loaded once per session."""

from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="session")
def repo_root() -> Path:
    return REPO_ROOT


@pytest.fixture(scope="session")
def chat_tokenizer(model_dir):
    from pipeline.tokenize import ChatTokenizer

    return ChatTokenizer(model_dir)


@pytest.fixture(scope="session")
def dump_hook():
    """The SGLang hook module, loaded from its file (it imports no sglang at module level)."""
    import importlib.util

    path = REPO_ROOT / "patches" / "sglang" / "v0_5_23" / "sitedir" / "hidden_harvest_hook.py"
    spec = importlib.util.spec_from_file_location("hidden_harvest_hook_under_test", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def make_dump(dump_hook, tmp_path):
    """Write a dump exactly as the hook does; returns its path. `header` entries override the real ones."""
    import hashlib

    import numpy as np

    def make(rid, input_ids, aux, last, **header):
        ids = np.asarray(input_ids, dtype=np.int32)
        real = {
            "rid": rid,
            "num_tokens": len(ids),
            "prefix_len": 0,
            "ids_sha256": hashlib.sha256(ids.tobytes()).hexdigest(),
            "aux_shape": list(aux.shape),
            "last_shape": list(last.shape),
            "source_dtype": "torch.bfloat16",
        }
        dump_hook._write_dump(str(tmp_path), rid, {**real, **header}, [aux.tobytes(), last.tobytes()])
        return tmp_path / f"{rid}.hhd"

    return make

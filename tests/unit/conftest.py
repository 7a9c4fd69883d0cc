"""Shared unit fixtures: the default model's tokenizer is loaded once per session."""

from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="session")
def repo_root() -> Path:
    return REPO_ROOT


@pytest.fixture(scope="session")
def chat_tokenizer(model_dir):
    from pipeline.intake.tokenize import ChatTokenizer

    return ChatTokenizer(model_dir)


SAMPLE = REPO_ROOT / "conf" / "data" / "sample_conversations.jsonl"


@pytest.fixture(scope="session")
def text_ids(model_dir) -> list[list[int]]:
    """Real conversations of mixed lengths (the job's kind of input; random tokens are noisy against fp32)."""
    from pipeline.intake.tokenize import Tokenize

    tok = Tokenize(str(model_dir), max_tokens=2048, overlength="reject")
    lines = [line for line in SAMPLE.read_text().splitlines() if '"messages"' in line and '"bad-' not in line]
    out = []
    for i, line in enumerate(lines):
        for r in tok.tokenize_line(f"x:{i}", line):
            if r["status"] == "ok" and 40 <= len(r["input_ids"]) <= 400:
                out.append(r["input_ids"])
        if len(out) == 5:
            break
    assert len({len(x) for x in out}) == 5
    return out


SITEDIR = REPO_ROOT / "patches" / "sglang" / "v0_5_23" / "sitedir"


@pytest.fixture(scope="session")
def hook_modules():
    """The server-side modules (they import no sglang at module level), as the server imports them."""
    import importlib
    import sys
    from types import SimpleNamespace

    sys.path.insert(0, str(SITEDIR))  # sitecustomize only runs at interpreter start: adding the dir is inert
    names = {"hook": "hidden_harvest_hook", "publisher": "hidden_harvest_publisher", "faults": "hidden_harvest_faults"}
    return SimpleNamespace(**{k: importlib.import_module(v) for k, v in names.items()})


@pytest.fixture
def publish(hook_modules, tmp_path):
    """The hook's real publisher on CPU tensors, writing into tmp_path; returns once the dumps are published."""
    publisher = hook_modules.publisher.DumpPublisher(str(tmp_path), "hh-")

    def run(rids, input_ids, hidden, aux, seq_lens, prefix_lens=None):
        publisher.capture(input_ids, hidden, aux, rids, seq_lens, prefix_lens)
        publisher.flush()

    return run


def bf16(bits):
    """uint16 bit patterns -> a torch bf16 tensor with exactly those bits."""
    import numpy as np
    import torch

    return torch.from_numpy(np.ascontiguousarray(bits, dtype=np.uint16).view(np.int16)).view(torch.bfloat16)


@pytest.fixture
def make_dump(publish, tmp_path):
    """Publish one request's dump exactly as the hook does; returns its path. `header` entries override real ones."""
    import json
    import struct

    import torch

    def make(rid, input_ids, aux, last, **header):
        publish([rid], torch.tensor(input_ids), bf16(last), [bf16(aux)], [len(input_ids)])
        path = tmp_path / f"{rid}.hhd"
        if header:
            data = path.read_bytes()
            (n,) = struct.unpack_from("<Q", data)
            head = json.dumps({**json.loads(data[8 : 8 + n]), **header}).encode()
            path.write_bytes(struct.pack("<Q", len(head)) + head + data[8 + n :])
        return path

    return make

"""Every recorded benchmark result says how to reproduce it: the command, the machine and the date, and no path
of the machine it ran on (WORK, OUT, TOKENIZER_DIR stand in for those)."""

from __future__ import annotations

import json
import re
from datetime import date
from pathlib import Path

import pytest

RESULTS = Path(__file__).resolve().parents[2] / "bench" / "results"
# The roots a run's own paths start from (scratch space, a home, a mount).
LOCAL_PATH = re.compile(r"(?<![\w.])/(?:tmp|root|home|Users|mnt)/")


def _commands(node) -> list[str]:
    """Every value under a `command` or `commands` key, however deep (some files record one per run)."""
    found: list[str] = []
    if isinstance(node, dict):
        for k, v in node.items():
            if k in ("command", "commands"):
                values = v if isinstance(v, list) else [v]
                found += [c for c in values if isinstance(c, str)]
            else:
                found += _commands(v)
    elif isinstance(node, list):
        for v in node:
            found += _commands(v)
    return found


def _files() -> list[Path]:
    return sorted(RESULTS.glob("*.json"))


def test_there_are_results():
    assert len(_files()) >= 10


@pytest.mark.parametrize("path", _files(), ids=lambda p: p.name)
def test_result_says_how_to_reproduce_it(path: Path):
    text = path.read_text()
    data = json.loads(text)
    assert isinstance(data, dict), "a result is one JSON object"
    date.fromisoformat(data.get("date", ""))  # raises on a missing or malformed date
    assert isinstance(data.get("machine"), str) and data["machine"].strip(), "no machine"
    commands = _commands(data)
    assert commands and all(c.strip() for c in commands), "no command to reproduce it"
    assert not LOCAL_PATH.search(text), f"a local path: {LOCAL_PATH.search(text).group(0)!r}"


def test_the_checks_catch_what_they_look_for():
    assert _commands({"runs": [{"result": {"command": "python bench/x.py"}}]}) == ["python bench/x.py"]
    assert _commands({"commands": ["a", "b"], "runs": {}}) == ["a", "b"]
    assert _commands({"benchmark": "x", "runs": [{"name": "y"}]}) == []
    assert LOCAL_PATH.search('"--work /tmp/w"')
    assert not LOCAL_PATH.search('"--work WORK/out and bench/results/tmp/x"')

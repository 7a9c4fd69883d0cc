"""extract.turns=each end to end: one sample per assistant turn, ids <id>#<k>, accounting, resume."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pipeline.format.manifest import read_manifest
from pipeline.format.shards import open_shards
from pipeline.format.storage import Store
from pipeline.intake.tokenize import Tokenize
from pipeline.tools.verify import verify

# The shipped sample set (not imported from conftest: under a full run `conftest` names tests/unit's).
SAMPLE_SET = Path(__file__).resolve().parents[2] / "conf" / "data" / "sample_conversations.jsonl"

pytestmark = pytest.mark.slow


def _agentic_rows(sample_path, n=3):
    rows = [json.loads(line) for line in sample_path.read_text().splitlines() if line.strip()]
    tools = [r for r in rows if "tools" in r][:1]
    reasoning = [r for r in rows if any("reasoning_content" in m for m in r.get("messages", [])) and "tools" not in r][
        :1
    ]
    multi = [
        r for r in rows if sum(m.get("role") == "assistant" for m in r.get("messages", [])) == 2 and r not in reasoning
    ]
    return tools + reasoning + multi[: n - 2]


def test_each_gives_one_sample_per_turn_and_resumes(ray_session, make_config, tmp_path, model_dir):
    from pipeline.driver.job import run

    rows = _agentic_rows(SAMPLE_SET)
    rows = [dict(r, id=r.get("id", f"row{i}")) for i, r in enumerate(rows)]
    lines = [json.dumps(r, ensure_ascii=False) for r in rows]
    path = tmp_path / "turns.jsonl"
    path.write_text("\n".join(lines + lines[:1]) + "\n")  # the first row twice: a duplicate, skipped whole
    turns = [sum(m["role"] == "assistant" for m in r["messages"]) for r in rows]
    expected_ids = sorted(f"{r['id']}#{k}" for r, n in zip(rows, turns) for k in range(n))

    out = tmp_path / "out"
    cfg = make_config(path, out, **{"extract.turns": "each"})
    totals = run(cfg).totals
    assert totals["input_rows"] == len(lines) + 1
    assert totals["samples"] == sum(turns) + turns[0]
    assert totals["filtered"] == turns[0] and totals["errors"] == 0
    assert totals["accounted"] == totals["samples"]
    stored = {s["sample_id"]: s for s in open_shards(str(out), as_torch=False)}
    assert sorted(stored) == expected_ids

    tok = Tokenize(str(model_dir), 2048, "reject", turns="each")
    for i, line in enumerate(lines):
        for r in tok.tokenize_line(f"x:{i}", line):
            assert stored[r["sample_id"]]["input_ids"].tolist() == r["input_ids"]
            assert stored[r["sample_id"]]["loss_mask"].tolist() == r["loss_mask"]

    manifest = read_manifest(Store(str(out)))
    assert manifest["data_settings"]["turns"] == "each"
    assert manifest["conversations"]["each"] == len(rows) + 1 and manifest["conversations"]["tokens_each"] > 0

    again = run(cfg)
    assert again.this_run.ok == 0 and again.totals == totals
    report = verify(str(out))
    assert report.ok, report.problems

"""Every line of the bad-input corpus becomes exactly one row: good ones tokenized, bad ones with their reason."""

import pyarrow as pa
import pytest
from bad_input_corpus import LINE_LIMIT_BYTES, MAX_TOKENS, write_corpus

from pipeline.intake.read import expand_inputs, read_lines
from pipeline.intake.stage import TokenizeLines
from pipeline.intake.tokenize import TOKENIZED_SCHEMA


@pytest.fixture(scope="module")
def stage(model_dir):
    return TokenizeLines(model_dir=str(model_dir), max_tokens=MAX_TOKENS, overlength="reject")


def test_every_corpus_line_is_one_row_with_its_reason(stage, tmp_path):
    corpus = write_corpus(tmp_path)
    lines = [r for u in expand_inputs(corpus.pattern) for r in read_lines({"path": u}, limit=LINE_LIMIT_BYTES)]
    out = stage(pa.Table.from_pylist(lines))
    assert out.schema == TOKENIZED_SCHEMA
    rows = {r["source"]: r for r in out.to_pylist()}
    assert len(rows) == out.num_rows == corpus.input_rows
    for source, expect in corpus.expected.items():
        if expect.stage == "dedup":  # the driver's job, across all rows
            assert rows[source]["status"] == "ok"
            continue
        assert expect.matches(rows[source]), (source, expect, rows[source])
    ok = [r for r in rows.values() if r["status"] == "ok"]
    assert len(ok) == corpus.good_rows + 1  # + the duplicate, filtered later
    assert set(corpus.good_ids) <= {r["sample_id"] for r in ok}


def test_an_unexpected_exception_on_one_line_is_that_line_s_error_row(stage, monkeypatch):
    def explode(source, line):
        if "boom" in line:
            raise RecursionError("maximum recursion depth exceeded")
        return real(source, line)

    real = stage.tokenize.tokenize_line
    monkeypatch.setattr(stage.tokenize, "tokenize_line", explode)
    batch = pa.table({"source": ["f:1", "f:2"], "line": ['{"text": "boom"}', '{"text": "fine"}']})
    first, second = stage(batch).to_pylist()
    assert (first["status"], first["stage"], first["source"]) == ("error", "tokenize", "f:1")
    assert first["reason"] == "cannot be tokenized: RecursionError: maximum recursion depth exceeded"
    assert second["status"] == "ok"


def test_missing_columns_are_named(stage):
    with pytest.raises(KeyError, match="line"):
        stage(pa.table({"source": ["f:1"]}))

"""Dirty input never aborts the job: every bad row ends in errors/ with its reason and source, every good
row is extracted, the job exits 0 and the totals add up. Hostile sample ids are stored as they are and
never reach a path. One real job (CLI entry point, real Ray + SGLang CPU server) over tests/bad_input_corpus.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from bad_input_corpus import HOSTILE_IDS, LINE_LIMIT_BYTES, MAX_TOKENS, write_corpus

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def corpus_run(ray_session, tmp_path_factory):
    from pipeline.cli import main

    root = tmp_path_factory.mktemp("corpus")
    corpus = write_corpus(root / "in")
    out = root / "out"
    argv = [
        "run",
        str(REPO / "conf" / "default.yaml"),
        "--set",
        f"input.path={corpus.pattern}",
        "--set",
        f"output.path={out}",
        "--set",
        f"extract.max_tokens={MAX_TOKENS}",
        "--set",
        f"input.max_line_bytes={LINE_LIMIT_BYTES}",
        "--set",
        "extract.batch_size=8",
        "--set",
        "engine.max_in_flight=4",
    ]
    return corpus, root, out, argv, main


def test_bad_rows_become_error_rows_and_good_rows_are_extracted(corpus_run, capsys):
    from pipeline.format.manifest import read_manifest
    from pipeline.format.shards import read_token_columns
    from pipeline.format.storage import Store
    from pipeline.tools.verify import verify

    corpus, root, out, argv, main = corpus_run
    assert main(argv) == 0
    stdout = capsys.readouterr().out

    errors = {}
    for f in (out / "errors").glob("*.jsonl"):
        for line in f.read_text().splitlines():
            row = json.loads(line)
            assert row["source"] not in errors, f"{row['source']} reported twice"
            errors[row["source"]] = row
    for source, expect in corpus.expected.items():
        assert source in errors, f"no error row for {source} ({expect})"
        assert expect.matches(errors[source]), (source, expect, errors[source])
    assert set(errors) == set(corpus.expected)

    stored = [sid for t in read_token_columns(str(out)) for sid in t["sample_id"].to_pylist()]
    assert len(stored) == len(set(stored)) == corpus.good_rows
    assert set(corpus.good_ids) <= set(stored)
    assert set(HOSTILE_IDS) <= set(stored)  # stored as they are

    totals = read_manifest(Store(str(out)))["totals"]
    n_filtered = sum(e.status == "filtered" for e in corpus.expected.values())
    assert totals["input_rows"] == corpus.input_rows
    assert (totals["samples_ok"], totals["errors"], totals["filtered"]) == (
        corpus.good_rows,
        len(corpus.expected) - n_filtered,
        n_filtered,
    )
    assert totals["accounted"] == totals["input_rows"]
    assert f"= {corpus.input_rows} of {corpus.input_rows} input rows" in stdout
    assert verify(str(out)).ok

    # No file of the run escaped its output (ids like ../../escape, /abs/path), and no name holds an id.
    assert sorted(p.name for p in root.iterdir()) == ["in", "out"]
    names = [p.name for p in out.rglob("*")]
    assert all(len(n) < 100 and "\x00" not in n for n in names)
    assert not [n for n in names if any(h in n for h in ("escape", "abs", "windows", "nul"))]


def test_an_input_of_only_empty_files_is_a_run_of_nothing(corpus_run, capsys):
    corpus, root, _, argv, main = corpus_run
    out = root / "empty-out"
    argv = [
        a.replace(corpus.pattern, str(Path(corpus.pattern).parent / "d-empty.jsonl")).replace(
            str(root / "out"), str(out)
        )
        for a in argv
    ]
    assert main(argv) == 0
    assert "0 ok + 0 errors + 0 filtered = 0 of 0 input rows" in capsys.readouterr().out
    assert not list((out / "shards").glob("*.parquet")) if (out / "shards").exists() else True


@pytest.mark.parametrize(
    "sets, message",
    [
        (["model.path=/nonexistent/model"], "model.path '/nonexistent/model' is not a HF model directory"),
        (["extract.aux_layers=[2, 30]"], "extract.aux_layers [2, 30]: the model has layers 0..29"),
        (["engine.device=cuda", "engine.tp_size=2"], "engine.tp_size=2 needs 2 GPUs on one node, but the largest node"),
        (["output.path=OUT_UNDER_A_FILE"], "cannot be written: NotADirectoryError"),
        (["output.path=s3://hh-no-such-bucket/out"], "output.path s3://hh-no-such-bucket/out cannot be written"),
    ],
    ids=[
        "missing-model",
        "aux-layer-out-of-range",
        "tp-over-node-gpus",
        "unwritable-local-output",
        "unreachable-s3-output",
    ],
)
def test_a_run_that_cannot_work_is_refused_before_extraction_in_one_line(corpus_run, capsys, sets, message):
    corpus, root, _, argv, main = corpus_run
    (root / "a-file").write_text("x")
    out = root / "refused"
    sets = [s.replace("OUT_UNDER_A_FILE", str(root / "a-file" / "out")) for s in sets]
    argv = [a.replace(str(root / "out"), str(out)) for a in argv] + [x for s in sets for x in ("--set", s)]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and err.startswith("harvest: ") and len(err.splitlines()) == 1, err
    assert "Traceback" not in err
    assert not out.exists()  # nothing was written: no lock, no manifest, no shard

"""Planning in the ledger: duplicates, committed ids and the rows still to do, checked case by case and against
the plain in-memory rules (what the driver did before the ledger) on a random input."""

from __future__ import annotations

import random

import pyarrow as pa
import pytest

from conf.schema import PlanConfig
from pipeline.driver.ledger import Ledger, skip_key_sql
from pipeline.driver.work import SkipList, _member, decide_work, skip_keys_of, still_to_do
from pipeline.format.errors import DUPLICATES, read_errors
from pipeline.format.storage import Store
from tests_support import commit_fake_batch


def samples(rows, turns=None) -> pa.Table:
    n = len(rows)
    cols = {
        "sample_id": [r[0] for r in rows],
        "source": [r[1] for r in rows],
        "num_tokens": pa.array([10] * n, pa.int32()),
        "num_masked": pa.array([4] * n, pa.int32()),
        "turns": [""] * n,
        "cost_full": pa.array([0] * n, pa.int64()),
        "cost_each": pa.array([0] * n, pa.int64()),
        "unrendered": [""] * n,
    }
    for name, values in (turns or {}).items():
        cols[name] = values
    return pa.table(cols)


def find_duplicates(rows, committed=()) -> dict[str, str]:
    with Ledger() as ledger:
        ledger.add_samples(samples(rows))
        ledger.add_committed(pa.table({"sample_id": pa.array(list(committed), pa.string())}))
        ledger.decide()
        return ledger.duplicates()


def test_no_duplicates():
    assert find_duplicates([("a", "f:1"), ("b", "f:2")]) == {}


def test_first_by_file_and_numeric_line_is_kept():
    rows = [("x", "data/a.jsonl:10"), ("x", "data/a.jsonl:9"), ("y", "data/a.jsonl:2"), ("x", "data/b.jsonl:1")]
    assert find_duplicates(rows) == {
        "data/a.jsonl:10": "duplicate sample_id 'x' (first seen at data/a.jsonl:9)",
        "data/b.jsonl:1": "duplicate sample_id 'x' (first seen at data/a.jsonl:9)",
    }


def test_line_100_comes_after_line_20_across_urls():
    rows = [("k", "s3://bucket/p/f.jsonl:100"), ("k", "s3://bucket/p/f.jsonl:20"), ("k", "s3://bucket/p/f.jsonl:3")]
    dups = find_duplicates(rows)
    assert set(dups) == {"s3://bucket/p/f.jsonl:100", "s3://bucket/p/f.jsonl:20"}
    assert all(r.endswith("(first seen at s3://bucket/p/f.jsonl:3)") for r in dups.values())


def test_result_does_not_depend_on_input_order():
    rows = [("a", f"f:{i}") for i in (12, 3, 7, 100)] + [("b", "f:1"), ("b", "e:50")]
    forward = find_duplicates(rows)
    assert forward == find_duplicates(rows[::-1])
    assert set(forward) == {"f:7", "f:12", "f:100", "f:1"}


def test_turns_of_one_row_are_not_duplicates_of_each_other():
    assert find_duplicates([("c#0", "f:1"), ("c#1", "f:1"), ("c#2", "f:1"), ("d", "f:2")]) == {}


def test_a_repeated_multi_turn_row_is_one_duplicate_source():
    rows = [("c#0", "f:1"), ("c#1", "f:1"), ("c#0", "f:5"), ("c#1", "f:5")]
    assert find_duplicates(rows) == {"f:5": "duplicate sample_id 'c#0' (first seen at f:1)"}


def test_sources_without_a_line_number_sort_as_line_zero():
    rows = [("z", "weird"), ("z", "f:x"), ("z", "f:0"), ("w", "a:b:7"), ("w", "a:b:12")]
    dups = find_duplicates(rows)
    # "weird" is (path "", line 0): first; "f:x" is (f, 0) like "f:0", and came first in the input.
    assert set(dups) == {"f:x", "f:0", "a:b:12"}
    assert dups["a:b:12"].endswith("(first seen at a:b:7)") and dups["f:0"].endswith("(first seen at weird)")


def test_conversation_summary_counts_rows_once_and_prices_both_policies():
    from pipeline.driver.work import conversation_plan

    rows = [
        ("f:1", "full", 100, 180, ""),  # one sample
        ("f:2", "each", 50, 120, "messages[2].reasoning_content"),  # two samples of one row
        ("f:2", "each", 50, 120, ""),
        ("f:3", "", 0, 0, ""),  # a pre-tokenized or text row
        ("f:4", "full", 30, 30, "messages[1].reasoning_content,tools"),
    ]
    cols = {
        "turns": [r[1] for r in rows],
        "cost_full": pa.array([r[2] for r in rows], pa.int64()),
        "cost_each": pa.array([r[3] for r in rows], pa.int64()),
        "unrendered": [r[4] for r in rows],
    }
    with Ledger() as ledger:
        ledger.add_samples(samples([(f"s{i}", r[0]) for i, r in enumerate(rows)], cols))
        s = conversation_plan(ledger.conversations(), "auto")
    assert (s["conversations"], s["full"], s["each"]) == (3, 2, 1)
    assert (s["tokens_full"], s["tokens_each"], s["tokens_chosen"]) == (180, 330, 100 + 120 + 30)
    assert s["unrendered"] == {"reasoning_content": 2, "tools": 1}
    assert "extract.turns=auto" in s["plan"] and "tokens 250 (full would be 180, each 330)" in s["plan"]


def test_the_ledgers_keys_are_the_filters_keys():
    import duckdb

    pairs = [("a", "f:1"), ("é#0", "s3://b/ü.jsonl:7"), ("", ""), ("1:x", "y"), ("1", ":xy")]
    con = duckdb.connect()
    con.execute("CREATE TABLE t (sample_id VARCHAR, source VARCHAR)")
    con.executemany("INSERT INTO t VALUES (?, ?)", pairs)
    sql = [tuple(r) for r in con.execute(f"SELECT {skip_key_sql()} FROM t").fetchall()]
    py = [tuple(int(v) for v in k) for k in skip_keys_of([p[0] for p in pairs], [p[1] for p in pairs])]
    assert sql == py and len(set(py)) == len(py)  # ("1:x", "y") and ("1", ":xy") differ


def test_membership_is_exact_on_all_128_bits():
    import numpy as np

    keys = np.array([[1, 5], [1, 9], [2, 1], [7, 7]], dtype=np.uint64)  # sorted, two share their high half
    q = np.array([[1, 9], [1, 6], [2, 1], [7, 8], [0, 5], [9, 9]], dtype=np.uint64)
    assert _member(keys, q).tolist() == [True, False, True, False, False, False]


def reference(rows, committed) -> tuple[set, dict]:
    """The rules as the driver applied them with Python sets (before the ledger): kept pairs, duplicates."""

    def key(source):
        path, _, line = source.rpartition(":")
        return (path, int(line) if line.isdigit() else 0)

    first, dups = {}, {}
    for sid, source in sorted(rows, key=lambda r: key(r[1])):
        if sid in first and first[sid] != source:
            dups.setdefault(source, f"duplicate sample_id {sid!r} (first seen at {first[sid]})")
        else:
            first[sid] = source
    keep = {(sid, s) for sid, s in rows if s not in dups and sid not in committed}
    return keep, dups


@pytest.mark.parametrize("store_kind", ["local", "s3"])
def test_a_random_input_is_planned_as_the_in_memory_rules_plan_it(ray_session, tmp_path, store_kind, request):
    """Duplicates (1 in 20 rows, some multi-turn), committed shards and errors with a partly stale index: the
    ledger, the duplicates file and the filtered dataset agree with the plain rules, and the plan's counts add up."""
    import ray.data

    if store_kind == "s3":
        request.getfixturevalue("s3_endpoint")
        import s3fs

        fs = s3fs.S3FileSystem()
        if not fs.exists("hh-plan"):
            fs.mkdir("hh-plan")
        store = Store(f"s3://hh-plan/{tmp_path.name}")
    else:
        store = Store(str(tmp_path / "out"))
    rng = random.Random(7)
    rows = []
    for line in range(3000):
        src = f"{'ab'[line % 2]}.jsonl:{line}"
        base = f"r{rng.randrange(60)}" if rng.random() < 0.05 else f"u{line}"
        turns = 2 if line % 7 == 0 else 1
        rows += [(f"{base}#{k}" if turns > 1 else base, src) for k in range(turns)]
    committed = set()
    for b in range(6):  # the fake batches' ids are b<k>-s<j>; make some of them input ids too
        committed.update(commit_fake_batch(store, b, 20, errors=3 if b % 2 else 0, index=b != 4))
    rows += [(sid, f"c.jsonl:{i}") for i, sid in enumerate(sorted(committed)[::2])]
    rng.shuffle(rows)
    keep, dups = reference(rows, committed)

    ds = ray.data.from_arrow(samples(rows)).repartition(7).materialize()
    work = decide_work(ds, store, "auto", PlanConfig(ledger_memory_mb=64, read_threads=4, batch_rows=1024))
    assert work.index.from_index == 8 and len(work.index.read) == 1  # 6 shards, 3 error files; batch 4 has no entry
    assert work.samples == len(rows) and work.input_rows == len({s for _, s in rows})
    assert work.duplicate_samples == sum(s in dups for _, s in rows)
    assert work.rows == len(keep) and work.duplicate_samples > 50
    assert work.rows + work.duplicate_samples + work.committed_samples == work.samples
    assert work.tokens == 10 * len(keep) and work.masked == 4 * len(keep)

    written = read_errors(store, DUPLICATES)
    assert [(r.source, r.sample_id) for r in written] == sorted((s, sid) for sid, s in rows if s in dups)
    assert all(r.reason == dups[r.source] and r.status == "filtered" for r in written)

    todo = still_to_do(ds, work.skip)
    got = [(r["sample_id"], r["source"]) for r in todo.take_all()]
    assert len(got) == len(set(got)) and set(got) == keep


def test_a_fresh_output_has_no_filter(ray_session):
    import ray.data

    ds = ray.data.from_arrow(samples([("a", "f:1")]))
    assert still_to_do(ds, None) is ds
    assert still_to_do(ds, SkipList((), 0)) is ds

import pyarrow as pa

from pipeline.job import default_aux_layers, find_duplicates


def test_default_aux_layers():
    assert default_aux_layers(30) == (2, 15, 27)
    assert default_aux_layers(32) == (2, 16, 29)


def table(rows):
    return pa.table({"sample_id": [r[0] for r in rows], "source": [r[1] for r in rows]})


def test_no_duplicates():
    assert find_duplicates(table([("a", "f:1"), ("b", "f:2")])) == {}


def test_first_by_file_and_numeric_line_is_kept():
    rows = [("x", "data/a.jsonl:10"), ("x", "data/a.jsonl:9"), ("y", "data/a.jsonl:2"), ("x", "data/b.jsonl:1")]
    dups = find_duplicates(table(rows))
    assert dups == {
        "data/a.jsonl:10": "duplicate sample_id 'x' (first seen at data/a.jsonl:9)",
        "data/b.jsonl:1": "duplicate sample_id 'x' (first seen at data/a.jsonl:9)",
    }


def test_line_100_comes_after_line_20_across_urls():
    rows = [("k", "s3://bucket/p/f.jsonl:100"), ("k", "s3://bucket/p/f.jsonl:20"), ("k", "s3://bucket/p/f.jsonl:3")]
    dups = find_duplicates(table(rows))
    assert set(dups) == {"s3://bucket/p/f.jsonl:100", "s3://bucket/p/f.jsonl:20"}
    assert all(r.endswith("(first seen at s3://bucket/p/f.jsonl:3)") for r in dups.values())


def test_result_does_not_depend_on_input_order():
    rows = [("a", f"f:{i}") for i in (12, 3, 7, 100)] + [("b", "f:1"), ("b", "e:50")]
    forward = find_duplicates(table(rows))
    assert forward == find_duplicates(table(rows[::-1]))
    assert set(forward) == {"f:7", "f:12", "f:100", "f:1"}

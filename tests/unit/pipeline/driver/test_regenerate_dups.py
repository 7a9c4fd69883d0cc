import pyarrow as pa

from pipeline.driver.regenerate import find_duplicates


def _ids(rows):
    return pa.table({"sample_id": [r[0] for r in rows], "source": [r[1] for r in rows]})


def test_the_first_row_by_file_and_line_keeps_its_id():
    # f:10 sorts after f:9 by line number, not as text; the later line is the duplicate wherever it was read.
    dups = find_duplicates(_ids([("a", "f:10"), ("a", "f:9"), ("b", "g:1")]))
    assert dups == {"f:10": "duplicate sample_id 'a' (first seen at f:9)"}


def test_no_duplicates_no_rows():
    assert find_duplicates(_ids([("a", "f:1"), ("b", "f:2")])) == {}

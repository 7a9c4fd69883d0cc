import pytest

from pipeline.intake.read import expand_inputs, read_lines


def rows_of(path, limit=1024):
    return read_lines({"path": str(path)}, limit=limit)


def test_a_line_that_is_not_utf8_is_one_error_row_and_its_neighbours_are_read(tmp_path):
    f = tmp_path / "in.jsonl"
    f.write_bytes(b'{"text": "one"}\n{"text": "caf\xe9"}\n{"text": "three"}\n')
    rows = rows_of(f)
    assert [r["source"] for r in rows] == [f"{f}:1", f"{f}:2", f"{f}:3"]
    assert [r["line"] for r in rows] == ['{"text": "one"}\n', "", '{"text": "three"}\n']
    assert rows[1]["read_error"] == "not valid UTF-8: byte 0xe9 at byte offset 13 of the line"
    assert rows[1]["read_id"].startswith("h") and rows[0]["read_error"] == rows[2]["read_error"] == ""


def test_an_over_long_line_is_an_error_row_and_the_next_line_is_still_read(tmp_path):
    f = tmp_path / "in.jsonl"
    f.write_bytes(b'{"text": "' + b"z" * 5000 + b'"}\n{"text": "next"}\n' + b"y" * 3000)
    rows = rows_of(f, limit=1024)
    assert rows[0]["read_error"] == "line is 5,013 bytes, over the 1,024-byte limit for one sample"
    assert rows[1]["line"] == '{"text": "next"}\n' and rows[1]["source"] == f"{f}:2"
    assert rows[2]["read_error"].startswith("line is 3,000 bytes") and rows[2]["source"] == f"{f}:3"


def test_blank_lines_are_skipped_but_keep_line_numbers_and_a_bom_is_dropped(tmp_path):
    f = tmp_path / "in.jsonl"
    f.write_bytes(b'\xef\xbb\xbf{"text": "a"}\n\n   \n{"text": "b"}')
    rows = rows_of(f)
    assert [(r["source"].rsplit(":", 1)[1], r["line"]) for r in rows] == [
        ("1", '{"text": "a"}\n'),
        ("4", '{"text": "b"}'),
    ]


def test_an_empty_file_gives_no_rows(tmp_path):
    f = tmp_path / "empty.jsonl"
    f.write_bytes(b"")
    assert rows_of(f) == []


def test_a_pattern_that_matches_nothing_is_refused(tmp_path):
    with pytest.raises(FileNotFoundError, match="matches no file"):
        expand_inputs(str(tmp_path / "*.jsonl"))


@pytest.mark.parametrize("chunk", [1, 7, 4096])
def test_lines_split_the_same_whatever_the_read_size(tmp_path, monkeypatch, chunk):
    monkeypatch.setattr("pipeline.intake.read._CHUNK", chunk)
    f = tmp_path / "in.jsonl"
    f.write_bytes(b'{"text": "a"}\n' + b"q" * 40 + b"\n\n" + b'{"text": "b"}\n' + b"r" * 50)
    rows = rows_of(f, limit=32)
    assert [(r["source"].rsplit(":", 1)[1], r["line"], r["read_error"][:13]) for r in rows] == [
        ("1", '{"text": "a"}\n', ""),
        ("2", "", "line is 41 by"),
        ("4", '{"text": "b"}\n', ""),
        ("5", "", "line is 50 by"),
    ]

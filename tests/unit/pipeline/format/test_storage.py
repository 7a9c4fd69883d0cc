import os

import pytest

from pipeline.format.storage import TMP_PREFIX, Store


@pytest.fixture
def store(tmp_path):
    return Store(str(tmp_path) + "/")


def test_local_store_paths(store, tmp_path):
    assert store.local
    assert store.url == str(tmp_path)
    assert store.path("a/b.txt") == f"{tmp_path}/a/b.txt"
    assert store.display("a") == f"{tmp_path}/a"


def test_write_read_size_exists_remove(store):
    store.write_bytes("d/x.bin", b"12345")
    assert store.exists("d/x.bin")
    assert store.read_bytes("d/x.bin") == b"12345"
    assert store.size("d/x.bin") == 5
    store.remove("d/x.bin")
    assert not store.exists("d/x.bin")


def test_list_is_sorted_filtered_and_hides_temporaries(store, tmp_path):
    for name in ("b.parquet", "a.parquet", "c.jsonl"):
        store.write_bytes(f"shards/{name}", b"x")
    (tmp_path / "shards" / f"{TMP_PREFIX}123-z.parquet").write_bytes(b"partial")
    assert store.list("shards", ".parquet") == ["shards/a.parquet", "shards/b.parquet"]
    assert store.list("shards") == ["shards/a.parquet", "shards/b.parquet", "shards/c.jsonl"]
    assert store.list("missing") == []


def test_clean_temporaries(store, tmp_path):
    store.write_bytes("shards/keep.parquet", b"x")
    for i in range(3):
        (tmp_path / "shards" / f"{TMP_PREFIX}{i}-part.parquet").write_bytes(b"partial")
    assert store.clean_temporaries("shards") == 3
    assert os.listdir(tmp_path / "shards") == ["keep.parquet"]
    assert store.clean_temporaries("shards") == 0
    assert store.clean_temporaries("missing") == 0


def test_open_atomic_commits_only_on_success(store, tmp_path):
    with store.open_atomic("out/f.bin") as f:
        f.write(b"part one ")
        assert not (tmp_path / "out" / "f.bin").exists()
        (pending,) = os.listdir(tmp_path / "out")
        assert pending.startswith(TMP_PREFIX) and pending.endswith("-f.bin")
        assert store.list("out") == []
        f.write(b"part two")
    assert store.read_bytes("out/f.bin") == b"part one part two"
    assert os.listdir(tmp_path / "out") == ["f.bin"]


def test_failure_inside_open_atomic_leaves_nothing(store, tmp_path):
    with pytest.raises(RuntimeError, match="boom"), store.open_atomic("out/f.bin") as f:
        f.write(b"half a file")
        raise RuntimeError("boom")
    assert os.listdir(tmp_path / "out") == []
    assert not store.exists("out/f.bin")


def test_failure_keeps_previous_committed_version(store):
    store.write_bytes("out/f.bin", b"v1")
    with pytest.raises(RuntimeError), store.open_atomic("out/f.bin") as f:
        f.write(b"v2 partial")
        raise RuntimeError("boom")
    assert store.read_bytes("out/f.bin") == b"v1"
    assert store.list("out") == ["out/f.bin"]


def test_object_store_calls_retry_with_backoff_then_fail():
    s3 = Store("s3://bucket/prefix")
    retries = s3.fs.config_kwargs["retries"]
    # botocore rewrites max_attempts (retries) into total_max_attempts (calls) in place once a client is made
    # from it, and fsspec hands out the same cached filesystem for the same options.
    assert (
        retries["mode"] == "standard" and retries.get("total_max_attempts", retries.get("max_attempts", 0) + 1) == 5
    ), retries
    assert s3.fs.config_kwargs["connect_timeout"] <= 10


def test_redact_blanks_credentials(monkeypatch):
    from pipeline.format.storage import redact

    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "AKIAEXAMPLEKEY")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "s3cr3t/with+chars")
    text = "key AKIAEXAMPLEKEY secret s3cr3t/with+chars url s3://me:pw@host/b"
    assert redact(text) == "key *** secret *** url s3://***@host/b"

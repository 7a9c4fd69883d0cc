"""The committed-ids index: resume trusts an entry only where the listing confirms it, and reads the files
themselves for everything else; an index out of date costs requests, never a wrong answer."""

from __future__ import annotations

import pyarrow as pa
import pytest

from pipeline.format.errors import reopen_transient_errors
from pipeline.format.ids_index import INDEX_DIR, IndexReport, committed_ids, compact, entry_name
from pipeline.format.shards import ids_digest
from pipeline.format.storage import Store
from tests_support import commit_fake_batch

BATCHES, PER_BATCH = 6, 5


@pytest.fixture(params=["local", "s3"])
def store(request, tmp_path):
    if request.param == "local":
        return Store(str(tmp_path / "out"))
    request.getfixturevalue("s3_endpoint")
    import s3fs

    fs = s3fs.S3FileSystem()
    if not fs.exists("hh-index"):
        fs.mkdir("hh-index")
    return Store(f"s3://hh-index/{tmp_path.name}")


def output(store) -> dict[str, str]:
    """A committed output of BATCHES batches, every other one with two error rows: {sample_id: status}."""
    truth = {}
    for b in range(BATCHES):
        ids = commit_fake_batch(store, b, PER_BATCH, errors=2 if b % 2 else 0)
        truth.update({sid: "error" if b % 2 and j < 2 else "ok" for j, sid in enumerate(ids)})
    return truth


def resume(store) -> tuple[dict[str, str], IndexReport]:
    report = IndexReport()
    tables = list(committed_ids(store, threads=4, report=report))
    got = pa.concat_tables(tables) if tables else None
    ids = got["sample_id"].to_pylist() if got else []
    assert len(ids) == len(set(ids)), "a sample reported twice"
    return dict(zip(ids, got["status"].to_pylist())) if got else {}, report


def test_a_whole_index_answers_without_reading_a_shard(store):
    truth = output(store)
    got, report = resume(store)
    assert got == truth
    assert report.entries == BATCHES and report.files == BATCHES + BATCHES // 2
    assert report.read == [] and report.from_index == report.files and report.stale == 0


def test_a_missing_entry_reads_its_files(store):
    truth = output(store)
    store.remove(entry_name(ids_digest([f"b1-s{j}" for j in range(PER_BATCH)])))
    got, report = resume(store)
    assert got == truth
    assert len(report.read) == 2  # batch 1's shard and error file
    # A shard committed with no entry at all (a crash between the shard and its entry) is read too.
    more = commit_fake_batch(store, 99, PER_BATCH, index=False)
    got, report = resume(store)
    assert got == truth | {sid: "ok" for sid in more} and len(report.read) == 3


def test_an_entry_whose_shard_is_gone_adds_nothing(store):
    truth = output(store)
    gone = commit_fake_batch(store, 50, PER_BATCH)
    store.remove(store.list("shards", ".parquet")[0])  # any one shard; its entry now names a missing file
    remaining = {sid for rel in store.list("shards", ".parquet") for sid in _shard_ids(store, rel)}
    got, report = resume(store)
    assert {s for s, st in got.items() if st == "ok"} == remaining
    assert report.stale == 1 and report.read == []
    assert set(got) <= set(truth) | set(gone)


def _shard_ids(store, rel):
    from pipeline.format.shards import shard_sample_ids

    return shard_sample_ids(store, rel)


def test_an_entry_with_wrong_ids_is_not_trusted(store):
    """An entry that names a real shard with its real size but other ids (or garbage bytes) is caught by the
    shard's own name, which is the digest of its ids."""
    import io

    import pyarrow.parquet as pq

    truth = output(store)
    rel = entry_name(ids_digest([f"b0-s{j}" for j in range(PER_BATCH)]))
    table = pq.read_table(io.BytesIO(store.read_bytes(rel)))
    ids = table["sample_id"].to_pylist()
    forged = table.set_column(2, "sample_id", pa.array(["b0-s0"] + ids[1:-1] + ["someone-else"]))
    sink = io.BytesIO()
    pq.write_table(forged, sink)
    store.write_bytes(rel, sink.getvalue())
    store.write_bytes(entry_name("garbage"), b"not parquet")
    got, report = resume(store)
    assert got == truth
    assert report.stale == 1 and report.unreadable == 1 and len(report.read) == 1


def test_an_error_file_rewritten_since_its_entry_is_read_again(store):
    """--retry-errors rewrites error files: the entry's size no longer matches, and the file decides."""
    truth = output(store)
    assert reopen_transient_errors(store) == 2 * (BATCHES // 2)
    got, report = resume(store)
    assert got == {s: st for s, st in truth.items() if st == "ok"}
    assert report.read == [] and report.stale == BATCHES // 2  # the error files are gone, their entries stale


def test_compaction_leaves_one_entry_with_the_same_answer(store):
    truth = output(store)
    store.remove(entry_name(ids_digest([f"b2-s{j}" for j in range(PER_BATCH)])))
    assert compact(store, threads=4) == BATCHES - 1
    assert len(store.list(INDEX_DIR, ".parquet")) == 1
    got, report = resume(store)
    assert got == truth
    assert report.entries == 1 and len(report.read) == 1  # batch 2's shard: it had no entry to merge


def test_the_drivers_checkpoints_replace_the_batches_entries(store):
    """Every `every` batches the driver puts one entry from the metadata rows it received (shard bytes as the
    rows' shares, the error file's size on every row) and removes the batches' own entries."""
    from pipeline.driver.checkpoint import IndexCheckpoint
    from pipeline.format.errors import error_file
    from pipeline.format.shards import shard_name

    ckpt = IndexCheckpoint(store, every=2)
    truth = {}
    for b in range(5):
        errors = 2 if b == 3 else 0
        ids = commit_fake_batch(store, b, PER_BATCH, errors=errors)
        ok = ids[errors:]
        size = store.size(shard_name(ok))
        statuses = ["error"] * errors + ["ok"] * len(ok)
        nbytes = [0] * errors + [size - (len(ok) - 1)] + [1] * (len(ok) - 1)  # shares that add up to the size
        err = error_file(ids_digest(ids))
        errors_bytes = store.size(err) if errors else 0
        ckpt.add_batch(ids, statuses, [7] * len(ids), nbytes, [""] * errors + [shard_name(ok)] * len(ok), errors_bytes)
        truth.update(zip(ids, statuses))
    ckpt.flush()
    entries = store.list(INDEX_DIR, ".parquet")
    assert ckpt.written == 3 and len(entries) == 3 and all("ckpt-" in e for e in entries)
    got, report = resume(store)
    assert got == truth and report.read == [] and report.stale == 0

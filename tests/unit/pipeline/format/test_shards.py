import json
import os
import threading

import numpy as np
import pyarrow.parquet as pq
import pytest

from pipeline.format.shards import (
    HIDDEN_COLUMNS,
    META_KEY,
    EncodedSample,
    ShardLayout,
    ShardWriter,
    encode_bits,
    list_shards,
    open_shards,
    read_layout,
    shard_name,
    shard_sample_ids,
    write_shard,
)
from pipeline.format.storage import TMP_PREFIX, Store
from tests_support import random_bf16

LAYOUT = ShardLayout(aux_layers=(2, 15, 27), hidden_size=16)


class Sample:
    def __init__(self, sample_id, input_ids, loss_mask, aux, last):
        self.sample_id, self.input_ids, self.loss_mask, self.aux, self.last = sample_id, input_ids, loss_mask, aux, last

    def encoded(self, layout=LAYOUT) -> EncodedSample:
        return encode_bits(self.sample_id, self.input_ids, self.loss_mask, self.aux, self.last, layout)


def make_samples(n=3, seed=0) -> list[Sample]:
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        t = int(rng.integers(1, 9))
        out.append(
            Sample(
                sample_id=f"s{i}",
                input_ids=rng.integers(0, 49152, t).tolist(),
                loss_mask=rng.integers(0, 2, t).tolist(),
                aux=random_bf16(rng, t, LAYOUT.aux_width),
                last=random_bf16(rng, t, LAYOUT.hidden_size),
            )
        )
    return out


@pytest.fixture(params=["planes_zstd", "raw"])
def written(tmp_path, request):
    store = Store(str(tmp_path))
    samples = make_samples()
    layout = ShardLayout(LAYOUT.aux_layers, LAYOUT.hidden_size, encoding=request.param)
    name, nbytes = write_shard(store, [s.encoded(layout) for s in samples], layout)
    return store, samples, name, nbytes


def test_round_trip_is_bit_exact(written, tmp_path):
    store, samples, name, nbytes = written
    assert nbytes == os.path.getsize(store.path(name))
    rows = list(open_shards(str(tmp_path), as_torch=False))
    assert [r["sample_id"] for r in rows] == [s.sample_id for s in samples]
    for r, s in zip(rows, samples):
        assert r["num_tokens"] == len(s.input_ids)
        assert r["input_ids"].tolist() == s.input_ids
        assert r["loss_mask"].tolist() == s.loss_mask
        assert r["aux_hidden_states"].dtype == np.uint16
        np.testing.assert_array_equal(r["aux_hidden_states"], s.aux)
        np.testing.assert_array_equal(r["last_hidden_state"], s.last)


def test_round_trip_as_torch_bf16(written, tmp_path):
    import torch

    _, samples, _, _ = written
    rows = list(open_shards(str(tmp_path)))
    for r, s in zip(rows, samples):
        assert r["aux_hidden_states"].dtype == torch.bfloat16
        assert tuple(r["aux_hidden_states"].shape) == s.aux.shape
        assert r["input_ids"].dtype == torch.int64
        got = r["last_hidden_state"].view(torch.int16).numpy().view(np.uint16)
        np.testing.assert_array_equal(got, s.last)


def test_shard_name_is_deterministic_and_order_independent():
    a = shard_name(["b", "a", "c"])
    assert a == shard_name(["a", "b", "c"]) == shard_name(["c", "a", "b"])
    assert a.startswith("shards/part-") and a.endswith(".parquet")
    assert len(a) == len("shards/part-.parquet") + 20
    assert shard_name(["a", "b"]) != a


def test_write_names_shard_from_its_samples(written):
    _, samples, name, _ = written
    assert name == shard_name([s.sample_id for s in reversed(samples)])


def test_hidden_columns_are_plain_uncompressed_binary(written):
    """The codec compressed them already: Parquet only copies the bytes (no dictionary, no second codec)."""
    store, _, name, _ = written
    meta = pq.ParquetFile(store.path(name)).metadata
    rg = meta.row_group(0)
    columns = {rg.column(i).path_in_schema: rg.column(i) for i in range(meta.num_columns)}
    for col in HIDDEN_COLUMNS:
        assert columns[col].physical_type == "BYTE_ARRAY"
        assert columns[col].compression == "UNCOMPRESSED"
        assert "RLE_DICTIONARY" not in columns[col].encodings
    assert columns["input_ids.list.element"].compression == "ZSTD"


def test_schema_metadata(written):
    store, _, name, _ = written
    schema = pq.read_schema(store.path(name))
    meta = json.loads(schema.metadata[META_KEY])
    assert meta == {
        "format_version": 3,
        "aux_layers": [2, 15, 27],
        "hidden_size": 16,
        "aux_width": 48,
        "dtype": "bfloat16",
        "storage": "bf16 bits as byte planes [2, W, T] (low plane stored, high plane per encoding), see README",
        "encoding": meta["encoding"],
        "last_hidden_state_rows": "all",
        "final_layer": "post_norm",  # this layout has no final norm: a pre-norm one adds it (test_final_norm.py)
    }
    assert meta["encoding"] in ("planes_zstd", "raw")
    assert read_layout(schema) == meta
    assert schema.names == ["sample_id", "input_ids", "loss_mask", "num_tokens", *HIDDEN_COLUMNS]


def test_plain_parquet_readers_get_ids_and_tokens(written):
    """id and token columns stay plain Parquet: pandas reads them, and the hidden columns come as bytes."""
    store, samples, name, _ = written
    df = pq.read_table(store.path(name)).to_pandas()
    assert df["sample_id"].tolist() == [s.sample_id for s in samples]
    assert [list(x) for x in df["input_ids"]] == [s.input_ids for s in samples]
    assert isinstance(df["aux_hidden_states"][0], bytes)


def test_read_layout_rejects_foreign_parquet():
    import pyarrow as pa

    with pytest.raises(ValueError, match="not a hidden-harvest shard"):
        read_layout(pa.schema([("x", pa.int32())]))


def test_no_temporaries_left_and_ids_listed(written):
    store, samples, name, _ = written
    assert os.listdir(store.path("shards")) == [name.split("/")[-1]]
    assert list_shards(store) == [name]
    assert shard_sample_ids(store, name) == [s.sample_id for s in samples]


def test_open_shards_skips_temporaries(written, tmp_path):
    store, samples, _, _ = written
    (tmp_path / "shards" / f"{TMP_PREFIX}abc-part-x.parquet").write_bytes(b"partial")
    assert len(list(open_shards(str(tmp_path), as_torch=False))) == len(samples)


def test_decode_row_rejects_inconsistent_sizes(tmp_path):
    store = Store(str(tmp_path))
    bad = make_samples(1)[0]
    bad.last = bad.last[:, :-1]
    write_shard(store, [bad.encoded()], LAYOUT)
    with pytest.raises(ValueError, match="does not decompress|bytes"):
        list(open_shards(str(tmp_path), as_torch=False))


def test_masked_last_hidden_state_round_trip(tmp_path):
    rng = np.random.default_rng(3)
    layout = ShardLayout((1, 2), 8, last_rows="masked")
    t = 6
    mask = [0, 0, 1, 1, 0, 1]
    aux = rng.integers(0, 0x7F00, size=(t, 16), dtype=np.uint16)
    last = rng.integers(0, 0x7F00, size=(t, 8), dtype=np.uint16)
    store = Store(str(tmp_path))
    name, _ = write_shard(store, [Sample("m", list(range(t)), mask, aux, last).encoded(layout)], layout)
    with store.fs.open(store.path(name), "rb") as f:
        stored = pq.read_table(f)["last_hidden_state"][0].as_py()
    assert len(stored) >= 3 * 8  # low plane of the three masked rows, then the compressed high plane
    assert layout.codec.decode_bits(stored, 3, 8).shape == (3, 8)  # only the three masked rows are stored
    (s,) = open_shards(str(tmp_path), as_torch=False)
    assert s["last_hidden_state_positions"].tolist() == [2, 3, 5]
    np.testing.assert_array_equal(s["last_hidden_state"][[2, 3, 5]], last[[2, 3, 5]])
    assert not s["last_hidden_state"][[0, 1, 4]].any()  # expanded with zeros where nothing is trained
    (c,) = open_shards(str(tmp_path), as_torch=False, expand_last=False)
    np.testing.assert_array_equal(c["last_hidden_state"], last[[2, 3, 5]])
    np.testing.assert_array_equal(c["aux_hidden_states"], aux)


def test_shard_writer_writes_row_groups_and_names_the_shard_at_commit(tmp_path):
    store = Store(str(tmp_path))
    samples = make_samples(5, seed=4)
    writer = ShardWriter(store, LAYOUT, row_group_bytes=1)  # every sample its own row group
    for s in samples:
        writer.add(s.encoded())
    assert list_shards(store) == []  # nothing visible before commit
    name, nbytes = writer.commit()
    assert name == shard_name([s.sample_id for s in samples]) and nbytes == os.path.getsize(store.path(name))
    assert pq.ParquetFile(store.path(name)).metadata.num_row_groups == 5
    rows = list(open_shards(str(tmp_path), as_torch=False))
    for r, s in zip(rows, samples):
        np.testing.assert_array_equal(r["aux_hidden_states"], s.aux)
    assert os.listdir(store.path("shards")) == [name.split("/")[-1]]


def test_shard_writer_abort_leaves_nothing(tmp_path):
    store = Store(str(tmp_path))
    with pytest.raises(RuntimeError), ShardWriter(store, LAYOUT, row_group_bytes=1) as writer:
        writer.add(make_samples(1)[0].encoded())
        raise RuntimeError("the batch failed mid-way")
    assert os.listdir(store.path("shards")) == []
    assert ShardWriter(store, LAYOUT).commit() == ("", 0)  # no samples, no shard


def test_shard_writer_flushes_each_row_group_to_the_disk(tmp_path, monkeypatch):
    """A local shard's row groups reach the disk while it is built (all but the last one written at any
    time), so the commit's fsync finds them written; the commit publishes only once every one is synced."""
    store = Store(str(tmp_path))
    synced: list[int] = []
    real = os.fdatasync

    def fdatasync(fd):
        real(fd)
        synced.append(os.fstat(fd).st_size)  # how much of the file this sync covered

    monkeypatch.setattr(os, "fdatasync", fdatasync)
    writer = ShardWriter(store, LAYOUT, row_group_bytes=1)
    sizes = []
    for s in make_samples(3, seed=5):
        writer.add(s.encoded())
        sizes.append(os.path.getsize(writer._tmp))
        assert len(synced) >= len(sizes) - ShardWriter.SYNCS_AHEAD  # the writer is at most one row group ahead
        assert synced == sorted(synced)
    name, nbytes = writer.commit()
    assert len(synced) == 3 and synced[-1] == sizes[-1] > 0  # one sync per row group, the last one whole
    assert nbytes == os.path.getsize(store.path(name)) > synced[-1]  # the footer comes at commit


def test_shard_writer_writes_the_next_row_group_while_the_disk_takes_the_last(tmp_path, monkeypatch):
    """The sync runs beside the writer: a flush does not wait for its own row group's sync, only for the one
    before it (at most SYNCS_AHEAD unsynced); a sync that fails fails the writer and leaves nothing."""
    store = Store(str(tmp_path))
    release = threading.Event()
    started = threading.Semaphore(0)

    def fdatasync(fd):
        started.release()
        assert release.wait(10)

    monkeypatch.setattr(os, "fdatasync", fdatasync)
    writer = ShardWriter(store, LAYOUT, row_group_bytes=1)
    a, b = make_samples(2, seed=6)
    writer.add(a.encoded())  # written; its sync blocks on the syncer thread, not here
    assert started.acquire(timeout=10)
    second = threading.Thread(target=writer.add, args=(b.encoded(),))
    second.start()
    second.join(0.3)
    assert second.is_alive()  # the second row group is written, then waits for the first one's sync
    release.set()
    second.join(10)
    assert not second.is_alive()
    name, _ = writer.commit()
    assert [r["sample_id"] for r in open_shards(str(tmp_path), as_torch=False)] == [a.sample_id, b.sample_id]

    def failing(fd):
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(os, "fdatasync", failing)
    with pytest.raises(OSError, match="Input/output"), ShardWriter(store, LAYOUT, row_group_bytes=1) as w:
        for s in make_samples(2, seed=7):
            w.add(s.encoded())
        w.commit()
    assert list_shards(store) == [name]  # the failed shard left nothing
    assert os.listdir(store.path("shards")) == [name.split("/")[-1]]

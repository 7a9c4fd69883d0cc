import hashlib
import json
import random
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from unittest import mock

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import actors.extractor as extractor_module
from actors.dump import Capture, CaptureHeader
from actors.engine import RequestResult
from actors.extractor import HiddenStateExtractor, _split_exact
from pipeline.format.codec import to_planes
from pipeline.format.shards import ShardLayout, open_shards, shard_name
from pipeline.format.shards import ids_digest as batch_digest
from pipeline.format.storage import Store


@pytest.mark.parametrize(
    "total, weights, expected",
    [
        (10_000, [100, 300, 600], [1000, 3000, 6000]),
        (1000, [1, 1, 1], [334, 333, 333]),
        (7, [5], [7]),
        (0, [3, 4], [0, 0]),
        (5, [0, 0], [5, 0]),
        (123, [], []),
    ],
)
def test_split_exact_examples(total, weights, expected):
    assert _split_exact(total, weights) == expected


@pytest.mark.parametrize("seed", range(20))
def test_split_exact_sums_exactly_and_is_proportional(seed):
    rng = random.Random(seed)
    weights = [rng.randint(1, 5000) for _ in range(rng.randint(1, 64))]
    total = rng.randint(0, 10**9)
    shares = _split_exact(total, weights)
    assert sum(shares) == total
    assert all(s >= 0 for s in shares)
    for s, w in zip(shares, weights):
        # Off from the exact proportion by less than one byte per sample (the remainder goes to one share).
        assert abs(s - total * w / sum(weights)) < len(weights)


def test_batch_digest_is_order_independent_and_content_sensitive():
    d = batch_digest(["b", "a", "c"])
    assert d == batch_digest(["c", "b", "a"])
    assert len(d) == 20 and int(d, 16) >= 0
    assert d != batch_digest(["a", "b"])
    assert d != batch_digest(["a", "b", "c", "c2"])
    # Error files and shards of the same batch share the digest scheme.
    assert shard_name(["a", "b", "c"]) == f"shards/part-{d}.parquet"


# --- the stage's bounded pipeline, on a stand-in engine (a unit-test aid; the real one is tested in tests/e2e) ---

LAYOUT = ShardLayout((1, 2), 8)


def fake_bits(ids: list[int], width: int) -> np.ndarray:
    """Deterministic bf16 bits from the ids: a sample stored with another's states would not match."""
    rng = np.random.default_rng(int(hashlib.sha256(np.asarray(ids, np.int32).tobytes()).hexdigest()[:8], 16))
    return rng.integers(0, 0x7F00, size=(len(ids), width), dtype=np.uint16)


class StandInEngine:
    """Answers after a delay from a pool of `window` workers, as a server with that in-flight window would."""

    def __init__(self, window: int, delay_s: float, nan_keys=()):
        self.pool = ThreadPoolExecutor(window)
        self.delay_s, self.nan_keys = delay_s, set(nan_keys)
        self.lock = threading.Lock()
        self.in_flight: dict[str, str] = {}  # key -> batch tag
        self.mixed = False  # requests of two batches in flight at once
        self.submitted: list[str] = []

    def start(self):
        return self

    def close(self):
        self.pool.shutdown()

    def ensure_alive(self):
        pass

    def stats(self):
        return {}

    def submit(self, key, ids, order=0.0):
        with self.lock:
            self.submitted.append(key)
        return self.pool.submit(self._answer, key, list(ids))

    def _answer(self, key, ids):
        with self.lock:
            self.in_flight[key] = key.split("-")[0]
            self.mixed |= len(set(self.in_flight.values())) > 1
        time.sleep(self.delay_s)
        with self.lock:
            del self.in_flight[key]
        n = len(ids)
        header = CaptureHeader(
            rid=key,
            num_tokens=n,
            prefix_len=0,
            ids_sha256=hashlib.sha256(np.asarray(ids, np.int32).tobytes()).hexdigest(),
            nonfinite=1 if key in self.nan_keys else 0,
            aux_shape=(n, LAYOUT.aux_width),
            last_shape=(n, 8),
            source_dtype="bfloat16",
            final_layer="post_norm",
        )
        body = np.concatenate(
            [to_planes(fake_bits(ids, LAYOUT.aux_width)).ravel(), to_planes(fake_bits(ids[::-1], 8)).ravel()]
        )
        return RequestResult(key, Capture(header, None, 0, body), None, self.delay_s)


def batch(tag: str, n: int) -> pa.Table:
    rows = [
        {
            "sample_id": f"{tag}-{i}",
            "source": f"in.jsonl:{i}",
            "input_ids": list(range(i + 1, i + 4 + i % 5)),
            "loss_mask": [1] * (3 + i % 5),
            "status": "ok",
            "stage": "",
            "reason": "",
        }
        for i in range(n)
    ]
    return pa.Table.from_pylist(rows)


def make_stage(tmp_path, engine: StandInEngine) -> HiddenStateExtractor:
    # The stage builds its engine from the registry by name; here the name resolves to the stand-in.
    with mock.patch.object(extractor_module, "engine_class", lambda name: lambda **_: engine):
        return HiddenStateExtractor("stand-in", {}, LAYOUT, str(tmp_path), retries=1, encode_threads=2)


def test_two_batches_share_the_window_and_commit_once_each(tmp_path):
    engine = StandInEngine(window=4, delay_s=0.02)
    stage = make_stage(tmp_path, engine)
    with ThreadPoolExecutor(2) as calls:  # as Ray runs batches_per_actor calls on threads of one actor
        a, b = calls.submit(stage, batch("a", 9)), calls.submit(stage, batch("b", 9))
        out = pa.concat_tables([a.result(), b.result()]).to_pylist()
    stage.close()
    assert engine.mixed  # the second batch's requests filled the window while the first was still in flight
    assert sorted(r["sample_id"] for r in out) == sorted([f"a-{i}" for i in range(9)] + [f"b-{i}" for i in range(9)])
    assert {r["status"] for r in out} == {"ok"} and len({r["shard"] for r in out}) == 2
    stored = {s["sample_id"]: s for s in open_shards(str(tmp_path), as_torch=False)}
    assert len(stored) == 18
    for s in stored.values():
        ids = s["input_ids"].tolist()
        np.testing.assert_array_equal(s["aux_hidden_states"], fake_bits(ids, LAYOUT.aux_width))
        np.testing.assert_array_equal(s["last_hidden_state"], fake_bits(ids[::-1], 8))
    shard_bytes = {r["shard"]: 0 for r in out}
    for r in out:
        shard_bytes[r["shard"]] += r["bytes"]
    assert shard_bytes == {name: (tmp_path / name).stat().st_size for name in shard_bytes}  # exact shares


def test_a_capture_with_nonfinite_values_is_retried_then_an_error_row(tmp_path):
    engine = StandInEngine(window=2, delay_s=0.0, nan_keys={"c-1"})
    stage = make_stage(tmp_path, engine)
    out = {r["sample_id"]: r for r in stage(batch("c", 3)).to_pylist()}
    stage.close()
    assert engine.submitted.count("c-1") == 2  # one retry (retries=1)
    assert out["c-1"]["status"] == "error" and out["c-1"]["reason"].startswith("1 non-finite hidden-state values")
    assert [out[k]["status"] for k in ("c-0", "c-2")] == ["ok", "ok"]
    assert sorted(s["sample_id"] for s in open_shards(str(tmp_path), as_torch=False)) == ["c-0", "c-2"]


def test_each_batch_puts_an_index_entry_that_resume_trusts_for_both_its_files(tmp_path):
    """The batch's shard and error file are named in one entry, with their sizes and ids: resume reads neither."""
    from pipeline.format.ids_index import IndexReport, committed_ids

    engine = StandInEngine(window=2, delay_s=0.0, nan_keys={"d-1"})
    stage = make_stage(tmp_path, engine)
    stage(batch("d", 4))
    stage.close()
    report = IndexReport()
    got = {}
    for t in committed_ids(Store(str(tmp_path)), threads=2, report=report):
        got.update(zip(t["sample_id"].to_pylist(), zip(t["status"].to_pylist(), t["num_tokens"].to_pylist())))
    assert (report.entries, report.files, report.from_index, report.read) == (1, 2, 2, [])
    assert got == {"d-0": ("ok", 3), "d-1": ("error", 0), "d-2": ("ok", 5), "d-3": ("ok", 6)}


def test_an_engine_with_counters_gets_each_batch_stamped_once_its_files_are_committed(tmp_path):
    class Counting(StandInEngine):
        def stats(self):
            return {"forwards": 3}

    stage = make_stage(tmp_path, Counting(window=2, delay_s=0.0))
    rows = stage(batch("a", 4)).to_pylist()
    stage.close()
    stats = {r["engine_stats"] for r in rows}
    assert len(stats) == 1  # one snapshot per batch, on every row
    stamp = json.loads(stats.pop())
    assert stamp["forwards"] == 3  # the engine's counters pass through as they are
    shard = tmp_path / rows[0]["shard"]
    # Taken after the shard was written (a file's time lags the clock, never leads it), so a run's tail can be
    # told into the last commit and Ray's return of the rows.
    assert shard.stat().st_mtime <= stamp["batch_committed_unix"] <= time.time()
    assert stamp["batch_committed_unix"] >= rows[0]["batch_started_unix"]
    # ...and split: the batch's last capture back, its encoders done, its files committed, in that order.
    assert rows[0]["batch_started_unix"] <= stamp["batch_captured_unix"] <= stamp["batch_encoded_unix"]
    assert stamp["batch_encoded_unix"] <= stamp["batch_committed_unix"]
    io = stamp["shard_io"]  # the actor's shard I/O so far: every encoded hidden-state byte of the shard
    table = pq.read_table(shard, columns=["aux_hidden_states", "last_hidden_state"])
    stored = sum(len(v) for c in table.columns for v in c.to_pylist())
    assert io["bytes"] == stored > 0
    assert min(io[k] for k in ("encode_wait_s", "build_s", "write_s", "sync_s")) >= 0 and io["commit_s"] > 0


def test_row_groups_follow_the_configured_size(tmp_path):
    """The stage's row-group size reaches its shard writer: a tiny size writes a row group per sample."""
    with mock.patch.object(extractor_module, "engine_class", lambda name: lambda **_: StandInEngine(2, 0.0)):
        stage = HiddenStateExtractor("stand-in", {}, LAYOUT, str(tmp_path), retries=1, row_group_bytes=1)
    rows = stage(batch("g", 4)).to_pylist()
    stage.close()
    (name,) = {r["shard"] for r in rows}
    assert pq.ParquetFile(tmp_path / name).metadata.num_row_groups == 4


def test_an_engine_without_counters_sends_none(tmp_path):
    stage = make_stage(tmp_path, StandInEngine(window=2, delay_s=0.0))
    rows = stage(batch("a", 2)).to_pylist()
    stage.close()
    assert {r["engine_stats"] for r in rows} == {""}


def test_row_groups_are_written_while_the_batch_keeps_taking_its_captures(tmp_path):
    """A row group on its way to the disk holds no capture back: every row group here waits until the stage has
    validated every capture of the batch, which a stage writing on its capturing thread would never do."""
    n = 5
    validated = threading.Event()
    calls = []
    real_check = extractor_module.check_capture
    waited: list[bool] = []

    def counting_check(*args):
        calls.append(1)
        if len(calls) == n:
            validated.set()
        return real_check(*args)

    class HeldWriter(extractor_module.ShardWriter):
        def _flush(self):
            if self._pending:
                waited.append(validated.wait(timeout=5))
            super()._flush()

    with (
        mock.patch.object(extractor_module, "check_capture", counting_check),
        mock.patch.object(extractor_module, "ShardWriter", HeldWriter),
        mock.patch.object(extractor_module, "engine_class", lambda name: lambda **_: StandInEngine(1, 0.01)),
    ):
        stage = HiddenStateExtractor("stand-in", {}, LAYOUT, str(tmp_path), retries=1, row_group_bytes=1)
        rows = stage(batch("w", n)).to_pylist()
    stage.close()
    assert waited and all(waited)  # no row group was written before the last capture was taken
    assert {r["status"] for r in rows} == {"ok"}
    (name,) = {r["shard"] for r in rows}
    assert pq.ParquetFile(tmp_path / name).metadata.num_row_groups == n  # one per sample (row_group_bytes=1)
    assert sorted(s["sample_id"] for s in open_shards(str(tmp_path), as_torch=False)) == [f"w-{i}" for i in range(n)]


def test_a_shard_that_cannot_be_written_fails_its_batch_and_leaves_nothing(tmp_path):
    """The writer's error reaches the batch (Ray retries it); no shard, temporary or index entry is left, and the
    actor's next batch commits as usual."""
    failing = {"left": 1}

    class FullDisk(extractor_module.ShardWriter):
        def _flush(self):
            if self._pending and failing["left"]:
                failing["left"] -= 1
                raise OSError(28, "No space left on device")
            super()._flush()

    with (
        mock.patch.object(extractor_module, "ShardWriter", FullDisk),
        mock.patch.object(extractor_module, "engine_class", lambda name: lambda **_: StandInEngine(2, 0.0)),
    ):
        stage = HiddenStateExtractor("stand-in", {}, LAYOUT, str(tmp_path), retries=1, row_group_bytes=1)
        with pytest.raises(OSError, match="No space left"):
            stage(batch("x", 4))
        assert [p for p in tmp_path.rglob("*") if p.is_file()] == []
        rows = stage(batch("y", 3)).to_pylist()
    stage.close()
    assert {r["status"] for r in rows} == {"ok"}
    assert sorted(s["sample_id"] for s in open_shards(str(tmp_path), as_torch=False)) == ["y-0", "y-1", "y-2"]

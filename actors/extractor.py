"""The Ray Data stage that owns an engine replica: tokens in, committed shards and metadata rows out.

Per batch: capture every ok sample (bounded retries), validate it, encode it, commit one shard and one
error file (and their entry in the ids index), and return one small metadata row per input row. Hidden states never leave this actor except
as a committed shard. A failing sample becomes an error row; a dead engine raises.

The overlap is one small bounded pipeline: Ray Data runs up to `engine.batches_per_actor` calls of this
stage at once on threads of the actor (job.py). Their requests share the engine's one in-flight window,
so while one batch encodes and commits its shard the next keeps the server busy; within a call each
sample goes to a shared pool of `output.encode_threads` encoders as soon as its capture is validated, and
encoded samples are written to the shard a row group at a time, on a writer thread of the batch's own, while
the rest are still captured.
Memory is bounded by batches_per_actor x batch_size samples (in practice: the requests in flight plus
about one row group per batch).
"""

from __future__ import annotations

import itertools
import json
import logging
import os
import queue
import socket
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor, as_completed

import pyarrow as pa

from actors.engine import Engine, engine_class
from actors.metrics import ExtractorMetrics
from actors.validate import check_capture
from pipeline.format.errors import ErrorRow, error_file, write_errors
from pipeline.format.ids_index import write_entry
from pipeline.format.shards import (
    ROW_GROUP_BYTES,
    EncodedSample,
    ShardLayout,
    ShardWriter,
    encode_sample,
    ids_digest,
)
from pipeline.format.storage import Store

logger = logging.getLogger(__name__)

REQUIRED_COLUMNS = ("sample_id", "source", "input_ids", "loss_mask", "status", "stage", "reason")
RESULT_SCHEMA = pa.schema(
    [
        ("sample_id", pa.string()),
        ("status", pa.string()),
        ("stage", pa.string()),
        ("reason", pa.string()),
        ("num_tokens", pa.int64()),
        ("bytes", pa.int64()),  # this sample's share of its shard's committed bytes (sums exactly)
        ("shard", pa.string()),
        ("latency_s", pa.float64()),
        ("actor", pa.string()),  # host:pid of the actor that decided the sample (balance across actors)
        ("engine_ready_unix", pa.float64()),  # when that actor's engine had started (rates after start-up)
        ("batch_started_unix", pa.float64()),  # when this batch reached the actor (dispatch gaps)
        ("engine_stats", pa.string()),  # the engine's counters so far as JSON, where it keeps them ("" otherwise)
        # The size of the batch's committed error file (0: none), on every row of the batch: with the rows'
        # ids and bytes it lets the driver vouch for the batch's files in the ids index (driver/checkpoint.py).
        ("errors_bytes", pa.int64()),
    ]
)


class HiddenStateExtractor:
    def __init__(
        self,
        engine_name: str,
        engine_kwargs: dict,
        layout: ShardLayout,
        output_url: str,
        retries: int,
        encode_threads: int | None = None,
        row_group_bytes: int = ROW_GROUP_BYTES,
    ):
        self.init_unix = time.time()  # when Ray had this actor's process up and running its code
        self.layout = layout
        self.retries = retries
        self.row_group_bytes = row_group_bytes
        # This actor's shard I/O so far (seconds summed over its batches' threads, and encoded bytes): with the
        # engine's clock it says whether the disk or the encoders keep a run's last batch from committing.
        self.io = {"encode_wait_s": 0.0, "build_s": 0.0, "write_s": 0.0, "sync_s": 0.0, "commit_s": 0.0, "bytes": 0}
        self._io_lock = threading.Lock()
        self.store = Store(output_url)
        self.metrics = ExtractorMetrics()
        self._order = itertools.count()
        self.pool = ThreadPoolExecutor(encode_threads or min(16, os.cpu_count() or 1), thread_name_prefix="encode")
        self.engine: Engine = engine_class(engine_name)(**engine_kwargs).start()
        self.actor = f"{socket.gethostname()}:{os.getpid()}"
        self.ready_unix = time.time()

    def close(self) -> None:
        engine = getattr(self, "engine", None)  # absent when __init__ failed before the engine started
        if engine is not None:
            engine.close()
        pool = getattr(self, "pool", None)
        if pool is not None:
            pool.shutdown(wait=False)

    def __del__(self):
        # Ray Data's only teardown hook for a callable-class stage: it drops the UDF on graceful actor
        # exit. The engine's lifecycle stays explicit (close()); this just calls it. Forced kills are
        # covered by the server's own watchdog (patches/), which ends a server whose starter is gone.
        self.close()

    def __call__(self, batch: pa.Table) -> pa.Table:
        started = time.time()
        missing = [c for c in REQUIRED_COLUMNS if c not in batch.column_names]
        if missing:
            raise KeyError(f"HiddenStateExtractor needs columns {missing}, got {batch.column_names}")
        rows = batch.to_pylist()
        todo = {r["sample_id"]: r for r in rows if r["status"] == "ok"}
        stamps: dict[str, float] = {}
        with ShardWriter(self.store, self.layout, self.row_group_bytes) as shard:
            failed, latency = self._capture(todo, shard, stamps)
            results = self._commit(rows, failed, latency, shard)
        committed = time.time()
        self.metrics.record(results)
        counters = self.engine.stats()
        with self._io_lock:
            for k, v in shard.timing.items():
                self.io[k] += v
            self.io["encode_wait_s"] += stamps.get("encode_wait_s", 0.0)
            self.io["bytes"] += shard.flushed_bytes
            # Microseconds: a small shard's commit (a rename) takes well under a millisecond, and rounded to
            # milliseconds it read as no commit at all.
            io = {k: round(v, 6) if isinstance(v, float) else v for k, v in self.io.items()}
        if counters.get("start") is not None:  # where this actor's start went, for the driver's start-up line
            counters["start"] = dict(counters["start"], actor_init_unix=self.init_unix, ready_unix=self.ready_unix)
        if counters:
            # When this batch's last capture came back, its last sample was encoded and its files were
            # committed: a run's tail splits into the actor's last encodings, its last shard's writes and
            # commit (engine's last results -> here), and Ray returning the rows (here -> the driver).
            counters.update(
                batch_captured_unix=stamps.get("captured_unix"),
                batch_encoded_unix=stamps.get("encoded_unix"),
                batch_committed_unix=committed,
                shard_io=io,
            )
        engine_stats = json.dumps(counters) if counters else ""
        for r in results:
            r.update(
                actor=self.actor,
                engine_ready_unix=self.ready_unix,
                batch_started_unix=started,
                engine_stats=engine_stats,
            )
        return pa.Table.from_pylist(results, schema=RESULT_SCHEMA)

    def _commit(self, rows: list[dict], failed: dict, latency: dict, shard: ShardWriter) -> list[dict]:
        """Commit the error file, then the shard; one metadata row per input row."""
        results: list[dict] = []
        error_rows = []
        for r in rows:
            sid = r["sample_id"]
            if r["status"] != "ok":
                error_rows.append(ErrorRow(sid, r["source"], r["status"], r["stage"], r["reason"]))
            elif sid in failed:
                error_rows.append(ErrorRow(sid, r["source"], "error", "extract", failed[sid]))

        digest = ids_digest([r["sample_id"] for r in rows])
        errors_rel = error_file(digest)
        errors_bytes = write_errors(self.store, errors_rel, error_rows)
        name, shard_bytes = shard.commit()
        shares = _split_exact(shard_bytes, shard.encoded_bytes)
        tokens = {r["sample_id"]: len(r["input_ids"]) for r in rows}
        # Last, after both files: an entry names only committed files, and one missing (a crash here) only
        # means resume reads these two files instead (pipeline/format/ids_index.py).
        files = []
        if name:
            files.append((name, shard_bytes, [(sid, "ok", tokens[sid]) for sid in shard.ids]))
        if errors_bytes:
            files.append((errors_rel, errors_bytes, [(e.sample_id, e.status, 0) for e in error_rows]))
        write_entry(self.store, digest, files)

        errors_by_id = {e.sample_id: e for e in error_rows}
        for r in rows:
            sid = r["sample_id"]
            if sid in errors_by_id:
                e = errors_by_id[sid]
                results.append(_result(sid, e.status, e.stage, e.reason, len(r["input_ids"])))
        for sid, share in zip(shard.ids, shares):
            results.append(_result(sid, "ok", "", "", tokens[sid], share, name, latency.get(sid, 0.0)))
        for r in results:
            r["errors_bytes"] = errors_bytes
        return results

    def _capture(self, todo: dict[str, dict], shard: ShardWriter, stamps: dict):
        """Capture, validate and encode every sample (bounded retries); encoded samples go to the shard as they
        finish, on the batch's writer thread. `stamps` gets when the last capture came back, when the last
        sample was encoded and written, and the seconds this thread waited for both after the last capture."""
        feed = _ShardFeed(shard)
        try:
            failed, latency = self._capture_into(todo, feed, stamps)
            t0 = time.time()
            feed.close()  # raises what the writer met (a full disk, an encoder's error)
        finally:
            feed.close(quiet=True)  # a batch that fails mid-capture still stops its writer before the abort
        stamps["encoded_unix"] = time.time()
        stamps["encode_wait_s"] = stamps["encoded_unix"] - t0
        return failed, latency

    def _capture_into(self, todo: dict[str, dict], feed: _ShardFeed, stamps: dict):
        failed: dict[str, str] = {}
        latency: dict[str, float] = {}
        pending = list(todo)
        for attempt in range(self.retries + 1):
            if not pending:
                break
            self.engine.ensure_alive()
            order = next(self._order)  # this batch's requests form one group for the engine
            futures = [self.engine.submit(sid, todo[sid]["input_ids"], order=order) for sid in pending]
            pending = []
            for fut in as_completed(futures):  # each sample is encoded while the others are still being captured
                res = fut.result()
                stamps["captured_unix"] = time.time()
                sid, row = res.key, todo[res.key]
                reason = res.error or check_capture(
                    res.capture,
                    row["input_ids"],
                    self.layout.aux_width,
                    self.layout.hidden_size,
                    self.layout.final_layer,
                    self.layout.codec.layout,
                )
                if reason is None:
                    feed.put(self.pool.submit(self._encode, sid, row, res.capture))
                    latency[sid] = res.latency_s
                    failed.pop(sid, None)
                else:
                    if res.capture is not None:
                        res.capture.release()
                    failed[sid] = f"{reason} (after {attempt + 1} attempts)"
                    pending.append(sid)
                feed.raise_error()  # a shard that cannot be written fails the batch now, not after its captures
            if pending:
                logger.warning(
                    "attempt %d: %d of %d samples failed, e.g. %s",
                    attempt + 1,
                    len(pending),
                    len(todo),
                    failed[pending[0]],
                )
                time.sleep(min(2.0**attempt, 10.0))
        return failed, latency

    def _encode(self, sid: str, row: dict, cap):
        try:  # the dump's body is read here, on an encoder thread
            if self.layout.last_rows == "all":
                aux, last = cap.encode(self.layout.codec)
                return EncodedSample(sid, row["input_ids"], row["loss_mask"], aux, last)
            return encode_sample(sid, row["input_ids"], row["loss_mask"], cap.aux, cap.last, self.layout)
        finally:
            cap.release()  # memory stays flat: only the encoded sample lives on until the shard is written


class _ShardFeed:
    """Writes a batch's encoded samples to its shard on a thread of the batch's own, in the order they finish.

    Row groups are written (and wait for the disk's sync of the one before, shards.SYNCS_AHEAD) while this
    batch's captures keep coming back: written on the capturing thread, a row group would hold the batch's
    next captures until it was on the disk, while the device had nothing left to do
    (bench/reports/hf-engine-longtail8k_h100-h200_2026-12-07.md). Only this thread touches the shard until
    close(); a sample leaves memory once its row group is written.
    """

    def __init__(self, shard: ShardWriter):
        self._shard = shard
        self._queue: queue.SimpleQueue[Future | None] = queue.SimpleQueue()
        self._done = threading.Condition()
        self._put = self._written = 0
        self._error: BaseException | None = None
        self._thread: threading.Thread | None = threading.Thread(target=self._loop, name="shard-writer", daemon=True)
        self._thread.start()

    def put(self, encoding: Future) -> None:
        """Write this sample once its encoder is done (callbacks run on the encoder, or here if already done)."""
        self._put += 1
        encoding.add_done_callback(self._queue.put)

    def raise_error(self) -> None:
        if self._error is not None:
            raise self._error

    def close(self, quiet: bool = False) -> None:
        """Wait until every sample put has been written (or dropped after an error), stop the thread, and raise
        the first error unless quiet. Called again, it only raises (or not)."""
        if self._thread is not None:
            with self._done:
                self._done.wait_for(lambda: self._written == self._put)
            self._queue.put(None)
            self._thread.join()
            self._thread = None
        if not quiet:
            self.raise_error()

    def _loop(self) -> None:
        while (encoding := self._queue.get()) is not None:
            try:
                if self._error is None:
                    self._shard.add(encoding.result())
            except BaseException as e:  # noqa: BLE001 - kept for the batch's thread to raise
                self._error = e
            finally:
                del encoding  # the future keeps the sample alive; the queue's item is the last other reference
                with self._done:
                    self._written += 1
                    self._done.notify_all()


def _split_exact(total: int, weights: list[int]) -> list[int]:
    """Integer shares of `total` proportional to weights that add up to exactly `total`."""
    if not weights:
        return []
    wsum = sum(weights) or 1
    shares = [total * w // wsum for w in weights]
    shares[0] += total - sum(shares)
    return shares


def _result(sid, status, stage, reason, num_tokens, nbytes=0, shard="", latency_s=0.0) -> dict:
    return {
        "sample_id": sid,
        "status": status,
        "stage": stage,
        "reason": reason,
        "num_tokens": num_tokens,
        "bytes": nbytes,
        "shard": shard,
        "latency_s": latency_s,
    }

"""Writing a shard: encoded samples into row groups, each sent to the disk as the next is written, and the
file published whole under its deterministic name (pipeline/format/shard_layout.py)."""

from __future__ import annotations

import contextlib
import os
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from pipeline.format.shard_layout import HIDDEN_COLUMNS, SHARD_DIR, ShardLayout, shard_name
from pipeline.format.storage import Store


@dataclass
class EncodedSample:
    """A validated sample whose hidden states are encoded: each column holds its stored value (uint8)."""

    sample_id: str
    input_ids: list[int]
    loss_mask: list[int]
    aux: np.ndarray
    last: np.ndarray

    @property
    def nbytes(self) -> int:
        return self.aux.nbytes + self.last.nbytes


def encode_sample(sample_id: str, input_ids, loss_mask, aux_body, last_body, layout: ShardLayout) -> EncodedSample:
    """The engine's bodies of both columns in the codec's layout (uint8, e.g. a view of a dump: planes
    [2, K*H, T] and [2, H, T], or fp8 scales and values) -> an EncodedSample. One thread."""
    codec = layout.codec
    if layout.last_rows == "masked":
        keep = np.asarray(loss_mask, dtype=bool)
        last_body = codec.select_tokens(last_body, keep.size, layout.hidden_size, keep)
    return EncodedSample(sample_id, list(input_ids), list(loss_mask), codec.encode(aux_body), codec.encode(last_body))


def encode_bits(
    sample_id: str, input_ids, loss_mask, aux_bits: np.ndarray, last_bits: np.ndarray, layout: ShardLayout
) -> EncodedSample:
    """From uint16 bf16 bits [T, K*H] and [T, H] (tests, benchmarks, engines without the device-side step)."""
    codec = layout.codec
    return encode_sample(
        sample_id, input_ids, loss_mask, codec.body_from_bits(aux_bits), codec.body_from_bits(last_bits), layout
    )


def _binary_column(values: list[np.ndarray]) -> pa.ChunkedArray:
    """One chunk per sample, wrapping its encoded value without a copy (the Parquet writer copies once)."""
    chunks = [
        pa.LargeBinaryArray.from_buffers(
            pa.large_binary(), 1, [None, pa.py_buffer(np.array([0, v.nbytes], np.int64)), pa.py_buffer(v)]
        )
        for v in values
    ]
    return pa.chunked_array(chunks, pa.large_binary())


def build_table(samples: list[EncodedSample], layout: ShardLayout) -> pa.Table:
    return pa.Table.from_arrays(
        [
            pa.chunked_array([pa.array([s.sample_id for s in samples], pa.string())]),
            pa.chunked_array([pa.array([s.input_ids for s in samples], pa.list_(pa.int32()))]),
            pa.chunked_array([pa.array([s.loss_mask for s in samples], pa.list_(pa.uint8()))]),
            pa.chunked_array([pa.array([len(s.input_ids) for s in samples], pa.int32())]),
            _binary_column([s.aux for s in samples]),
            _binary_column([s.last for s in samples]),
        ],
        schema=layout.schema(),
    )


# A row group is written once this many encoded bytes are waiting: the shard is written while later
# samples are still being captured and encoded, and memory holds about one row group, not one shard.
# What waits when a batch's last capture comes back is written after it, at the disk's pace, while the
# job is already over for the device, so a smaller row group shortens the run's tail; below this size the
# tail is paced by the writing itself (bench/results/benchmix_sync_behind_h200.json,
# longtail_sync_behind_h200.json). output.row_group_mb sets it per job.
ROW_GROUP_BYTES = 64 << 20


def _sync_and_drop(fd: int) -> None:
    getattr(os, "fdatasync", os.fsync)(fd)  # macOS has only fsync
    if hasattr(os, "posix_fadvise"):
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)


class ShardWriter:
    """Builds one shard row group by row group; nothing is visible until commit() (temporary, then rename/put).

    The name is decided at commit from the ids written, so the same set of samples always gets the same name.
    """

    # Row groups written but not yet on the disk, at most (local shards): the writer waits past this.
    SYNCS_AHEAD = 1

    def __init__(self, store: Store, layout: ShardLayout, row_group_bytes: int = ROW_GROUP_BYTES):
        self.store, self.layout, self.row_group_bytes = store, layout, row_group_bytes
        self.ids: list[str] = []
        self.encoded_bytes: list[int] = []
        self._pending: list[EncodedSample] = []
        self._pending_bytes = 0
        self._tmp: str | None = None
        self._file = self._writer = None
        # Seconds this shard spent building row groups, writing them, waiting for the disk (fdatasync) and
        # committing (close, fsync, rename), and the encoded bytes written: where a run's shard I/O goes.
        self.timing = {"build_s": 0.0, "write_s": 0.0, "sync_s": 0.0, "commit_s": 0.0}
        self.flushed_bytes = 0
        self._syncer: ThreadPoolExecutor | None = None  # local shards: the row groups' fdatasync (_sync_behind)
        self._syncs: list[Future] = []

    def add(self, sample: EncodedSample) -> None:
        self._pending.append(sample)
        self._pending_bytes += sample.nbytes
        if self._pending_bytes >= self.row_group_bytes:
            self._flush()

    def _flush(self) -> None:
        if not self._pending:
            return
        t0 = time.monotonic()
        table = build_table(self._pending, self.layout)
        if self._writer is None:
            self._tmp = self.store.stage(SHARD_DIR)
            self._file = pa.OSFile(self._tmp, "wb")
            # Per-column settings name Parquet leaf paths (a list column's leaf is `col.list.element`).
            plain = [
                f"{f.name}.list.element" if pa.types.is_list(f.type) else f.name
                for f in table.schema
                if f.name not in HIDDEN_COLUMNS
            ]
            self._writer = pq.ParquetWriter(
                self._file,
                table.schema,
                compression={**{c: "zstd" for c in plain}, **{c: "none" for c in HIDDEN_COLUMNS}},
                compression_level={c: self.layout.zstd_level for c in plain},
                use_dictionary=["sample_id"],
                write_statistics=["sample_id", "num_tokens"],
                # One hidden-state value per page: a page is limited to 2 GiB, a row group of large values is not.
                write_batch_size=1,
            )
        t1 = time.monotonic()
        self._writer.write_table(table, row_group_size=table.num_rows)
        t2 = time.monotonic()
        if self.store.local:
            self._sync_behind()
        self.timing["build_s"] += t1 - t0
        self.timing["write_s"] += t2 - t1
        self.timing["sync_s"] += time.monotonic() - t2
        self.flushed_bytes += self._pending_bytes
        self.ids += [s.sample_id for s in self._pending]
        self.encoded_bytes += [s.nbytes for s in self._pending]
        self._pending, self._pending_bytes = [], 0

    def _sync_behind(self) -> None:
        """Send the row group just written to the disk on the shard's syncer thread, and go on.

        Each row group goes to the disk as it is written: left to the page cache, a shard's gigabytes stay
        dirty until the commit's fsync writes them all at once, several shards then commit together at the end
        of a run, and the job waits on the disk while the GPU has nothing left. Synced on the writing thread,
        though, the page cache's copy and the disk's write of a shard take turns, and a batch writing alone
        barely keeps up with its captures. Here the disk takes one row group while the next is written
        (bench/results/longtail_sync_behind_h200.json); at most SYNCS_AHEAD wait unsynced, which bounds the
        dirty memory. Written pages are dropped from the cache too: nothing reads them back from this process."""
        if self._syncer is None:
            self._syncer = ThreadPoolExecutor(1, thread_name_prefix="shard-sync")
        self._syncs.append(self._syncer.submit(_sync_and_drop, self._file.fileno()))
        while len(self._syncs) > self.SYNCS_AHEAD:
            self._syncs.pop(0).result()  # raises what the disk said (EIO, ENOSPC)

    def _synced(self) -> None:
        """Every row group written so far is on the disk (and the syncer gone)."""
        try:
            while self._syncs:
                self._syncs.pop(0).result()
        finally:
            if self._syncer is not None:
                self._syncer.shutdown(wait=True)
                self._syncer = None

    def commit(self) -> tuple[str, int]:
        """Write what is left, close and publish; returns (relative name, exact bytes committed), ("", 0) if empty."""
        self._flush()
        if self._writer is None:
            return "", 0
        t0 = time.monotonic()
        self._synced()
        self.timing["sync_s"] += time.monotonic() - t0
        t0 = time.monotonic()
        self._writer.close()
        self._file.close()
        self._writer = None
        name = shard_name(self.ids)
        self.store.commit_staged(self._tmp, name)
        self._tmp = None
        size = self.store.size(name)
        self.timing["commit_s"] += time.monotonic() - t0
        return name, size

    def abort(self) -> None:
        """Drop a shard that will not be committed (the temporary is removed; nothing was visible)."""
        with contextlib.suppress(OSError):  # a disk that failed a sync fails the batch already
            self._synced()
        if self._writer is not None:
            self._writer.close()
            self._file.close()
            self._writer = None
        if self._tmp and os.path.exists(self._tmp):
            os.remove(self._tmp)
        self._tmp = None

    def __enter__(self) -> ShardWriter:
        return self

    def __exit__(self, exc_type, *exc) -> None:
        if exc_type is not None:
            self.abort()


def write_shard(store: Store, samples: list[EncodedSample], layout: ShardLayout) -> tuple[str, int]:
    """Commit one shard atomically; returns (relative name, exact bytes committed)."""
    with ShardWriter(store, layout) as writer:
        for s in samples:
            writer.add(s)
        return writer.commit()

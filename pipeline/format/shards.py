"""The shard format: one Parquet file per actor batch, one row per sample.

Columns: sample_id string, input_ids list<int32>, loss_mask list<uint8>, num_tokens int32 (plain Parquet, zstd),
aux_hidden_states large_binary ([T, K*H]) and last_hidden_state large_binary ([T, H], or [M, H] for the masked
rows), each value one sample's states in the codec's layout (pipeline/format/codec.py; the README shows the decoders):
bf16 bits (lossless: `planes_zstd`, `raw`) or per-token scaled e4m3 (`fp8`), which every reader here dequantizes
to bf16.
Format 3 stores the final layer before the model's final norm, with the norm in the metadata
(pipeline/format/final_norm.py); readers give the post-norm state unless asked for the stored one. Format 2
stored it after the norm, and stays readable.
Hidden-state values are already compressed, so Parquet stores them uncompressed, unencoded, one page per value:
the writer only copies bytes. Shape, layer ids and encoding live in the schema metadata (key `hidden_harvest`)
and in manifest.json; `open_shards` hides the codec.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import time
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from pipeline.format.codec import Codec
from pipeline.format.final_norm import FinalNorm
from pipeline.format.storage import Store

FORMAT_VERSION = 3
FINAL_LAYERS = ("post_norm", "pre_norm", "stored")  # what a reader may ask for as last_hidden_state
META_KEY = b"hidden_harvest"
SHARD_DIR = "shards"
HIDDEN_COLUMNS = ("aux_hidden_states", "last_hidden_state")
LAYOUT_DOC = {
    "planes": "bf16 bits as byte planes [2, W, T] (low plane stored, high plane per encoding), see README",
    "fp8": "one zstd frame: float32 scales (bf16 values) [W/H, T] (one per token per layer block), then e4m3fn [W, T]",
}


@dataclass(frozen=True)
class ShardLayout:
    aux_layers: tuple[int, ...]
    hidden_size: int
    encoding: str = "planes_zstd"
    zstd_level: int = 1
    last_rows: str = "all"  # "all" | "masked": rows of last_hidden_state kept
    final_norm: FinalNorm | None = None  # set: the final layer is stored pre-norm, and this turns it post-norm

    @property
    def final_layer(self) -> str:
        return "pre_norm" if self.final_norm is not None else "post_norm"

    @property
    def aux_width(self) -> int:
        return len(self.aux_layers) * self.hidden_size

    @property
    def codec(self) -> Codec:
        return Codec(self.encoding, self.zstd_level, self.hidden_size)

    def metadata(self) -> dict:
        return {
            "format_version": FORMAT_VERSION,
            "aux_layers": list(self.aux_layers),
            "hidden_size": self.hidden_size,
            "aux_width": self.aux_width,
            "dtype": "bfloat16",
            "storage": LAYOUT_DOC[self.codec.layout],
            "encoding": self.encoding,
            **({"stored_dtype": "float8_e4m3fn", "scale_block": self.hidden_size} if self.encoding == "fp8" else {}),
            "last_hidden_state_rows": self.last_rows,
            "final_layer": self.final_layer,
            **({"final_norm": self.final_norm.to_json()} if self.final_norm is not None else {}),
        }

    def schema(self) -> pa.Schema:
        return pa.schema(
            [
                ("sample_id", pa.string()),
                ("input_ids", pa.list_(pa.int32())),
                ("loss_mask", pa.list_(pa.uint8())),
                ("num_tokens", pa.int32()),
                ("aux_hidden_states", pa.large_binary()),
                ("last_hidden_state", pa.large_binary()),
            ],
            metadata={META_KEY: json.dumps(self.metadata()).encode()},
        )


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


def ids_digest(sample_ids: list[str]) -> str:
    """Order-independent digest of a set of sample ids: names shards and error files deterministically."""
    return hashlib.sha256("\n".join(sorted(sample_ids)).encode()).hexdigest()[:20]


def shard_name(sample_ids: list[str]) -> str:
    """Deterministic: the same set of samples always lands in the same file name."""
    return f"{SHARD_DIR}/part-{ids_digest(sample_ids)}.parquet"


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
# job is already over for the device: at 256 MB the benchmark mix on an H200 ended 1.33 s after its last
# forward's results (0.83 s of it the last row group), at 64 MB 0.40 s (0.923 -> 0.939 of the bare
# engine); the long-tailed mix ended 0.96 s after in both (bench/results/benchmix_sync_behind_h200.json,
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
        though, the page cache's copy and the disk's write of a shard take turns: on the H200 host's long-tailed
        mix the batch threads spent 14.2 s writing and 13.0 s waiting for fdatasync for 18.9 GB, 0.69 GB/s a
        shard against 0.64 GB/s of encoded output: a batch writing alone barely kept up with its captures.
        Here the disk takes one row group while the next is written (the wait fell to 0.7 s; the run's tail
        stayed at ~0.96 s, paced by the writing itself: bench/results/longtail_sync_behind_h200.json); at most
        SYNCS_AHEAD wait unsynced, which bounds the dirty memory. Written pages are dropped from the cache too: nothing reads them back from this process."""
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


def read_layout(schema: pa.Schema) -> dict:
    meta = (schema.metadata or {}).get(META_KEY)
    if meta is None:
        raise ValueError("not a hidden-harvest shard: schema metadata has no `hidden_harvest` key")
    return json.loads(meta)


def _bf16(bits: np.ndarray):
    import torch

    return torch.from_numpy(np.ascontiguousarray(bits).view(np.int16).copy()).view(torch.bfloat16)


def hidden_bits(table: pa.Table, column: str, i: int, meta: dict, rows: int, width: int) -> np.ndarray:
    """One sample's hidden column as uint16 bf16 bits [rows, width]; raises ValueError when it does not decode."""
    if meta.get("format_version", 1) == 1:  # list<uint16>, row-major (outputs written before the codec)
        bits = table[column][i].values.to_numpy(zero_copy_only=False)
        if bits.size != rows * width:
            raise ValueError(f"{column} of sample {i} holds {bits.size} values, expected {rows * width}")
        return bits.reshape(rows, width)
    return codec_of(meta).decode_bits(table[column][i].as_buffer(), rows, width)


def codec_of(meta: dict) -> Codec:
    """The codec a shard's metadata names (fp8 needs the block: the hidden size)."""
    return Codec(meta["encoding"], block=int(meta["hidden_size"]))


_norms: dict[str, FinalNorm] = {}  # by weight sha256: parsed once per process, not per row


def final_norm_of(meta: dict) -> FinalNorm | None:
    """The final norm stored with a shard whose final layer is pre-norm; None for post-norm shards."""
    d = meta.get("final_norm")
    if stored_final_layer(meta) != "pre_norm":
        return None
    if d is None:
        raise ValueError("a pre-norm shard without its final norm in the metadata")
    norm = _norms.get(d["weight_sha256"])
    if norm is None:
        norm = _norms[d["weight_sha256"]] = FinalNorm.from_json(d)
    return norm


def stored_final_layer(meta: dict) -> str:
    """How a shard stores the final layer: format 3 says; formats 1 and 2 stored it after the norm."""
    return meta.get("final_layer", "post_norm")


def decode_row(
    table: pa.Table, i: int, meta: dict, as_torch: bool = True, expand_last: bool = True, final: str = "post_norm"
) -> dict:
    """One sample: aux [T, K*H] and last [T, H] bf16 (torch) or uint16 bits (numpy), input_ids, loss_mask.

    `final`: what last_hidden_state holds. post_norm (default): after the model's final norm, applied here
    to a pre-norm shard (float32 math, one bf16 rounding); pre_norm: before it, which a post-norm shard
    (format 2, or extract.final_layer=post_norm) cannot give (ValueError); stored: as stored.
    `final_layer` in the result says which it is.

    Outputs written with last_hidden_state_rows="masked" store the final state only where loss_mask is 1:
    `last_hidden_state_positions` gives those positions; with expand_last (default) `last_hidden_state`
    is [T, H] with zeros elsewhere, without it the stored [M, H] rows.
    """
    return decode_sample(
        table["sample_id"][i].as_py(),
        table["input_ids"][i].values.to_numpy(zero_copy_only=False),
        table["loss_mask"][i].values.to_numpy(zero_copy_only=False),
        table["num_tokens"][i].as_py(),
        lambda column, rows, width: hidden_bits(table, column, i, meta, rows, width),
        meta,
        as_torch,
        expand_last,
        final,
    )


def decode_sample(
    sample_id: str,
    ids: np.ndarray,
    mask: np.ndarray,
    n: int,
    hidden,
    meta: dict,
    as_torch: bool = True,
    expand_last: bool = True,
    final: str = "post_norm",
) -> dict:
    """`decode_row` from a sample's parts, wherever they were read (a Parquet table, a Ray Data batch):
    `hidden(column, rows, width)` gives a hidden column's uint16 bits [rows, width]."""
    if final not in FINAL_LAYERS:
        raise ValueError(f"final={final!r}: one of {FINAL_LAYERS}")
    stored = stored_final_layer(meta)
    if final == "pre_norm" and stored != "pre_norm":
        raise ValueError(
            "this output stores the final layer after the model's final norm (format "
            f"{meta.get('format_version', 1)}, final_layer {stored}): the pre-norm state cannot be recovered from "
            "it; extract again with extract.final_layer=pre_norm"
        )
    out = {"sample_id": sample_id, "num_tokens": n}
    h = meta["hidden_size"]
    masked = meta.get("last_hidden_state_rows", "all") == "masked"
    last_rows = int(mask.sum()) if masked else n
    if ids.size != n or mask.size != n:
        raise ValueError(f"sample {sample_id}: token columns do not match {n} tokens")
    aux = hidden("aux_hidden_states", n, meta["aux_width"])
    last = hidden("last_hidden_state", last_rows, h)
    out["final_layer"] = stored
    if final == "post_norm" and stored == "pre_norm":
        last = final_norm_of(meta).apply_bits(last)
        out["final_layer"] = "post_norm"
    if masked:
        positions = np.flatnonzero(mask)
        out["last_hidden_state_positions"] = positions
        if expand_last:
            full = np.zeros((n, h), dtype=np.uint16)
            full[positions] = last
            last = full
    if as_torch:
        import torch

        out.update(
            input_ids=torch.from_numpy(ids.astype(np.int64)),
            loss_mask=torch.from_numpy(mask.copy()),
            aux_hidden_states=_bf16(aux),
            last_hidden_state=_bf16(last),
        )
        if masked:
            out["last_hidden_state_positions"] = torch.from_numpy(out["last_hidden_state_positions"])
    else:
        out.update(input_ids=ids, loss_mask=mask, aux_hidden_states=aux, last_hidden_state=last)
    return out


def list_shards(store: Store) -> list[str]:
    return store.list(SHARD_DIR, ".parquet")


def open_shards(path: str, as_torch: bool = True, expand_last: bool = True, final: str = "post_norm") -> Iterator[dict]:
    """Yield every committed sample under an output (local dir or s3://), shard by shard (`final` as in
    `decode_row`)."""
    store = Store(path)
    for rel in list_shards(store):
        with store.fs.open(store.path(rel), "rb") as f:
            table = pq.read_table(f)
        meta = read_layout(table.schema)
        for i in range(table.num_rows):
            yield decode_row(table, i, meta, as_torch=as_torch, expand_last=expand_last, final=final)


def read_token_columns(path: str) -> Iterator[pa.Table]:
    """sample_id, num_tokens, input_ids, loss_mask of every shard, without touching hidden states."""
    store = Store(path)
    for rel in list_shards(store):
        with store.fs.open(store.path(rel), "rb") as f:
            yield pq.read_table(f, columns=["sample_id", "num_tokens", "input_ids", "loss_mask"])


def shard_sample_ids(store: Store, rel: str) -> list[str]:
    """Only the id column: resume and verify never read hidden states for this."""
    with store.fs.open(store.path(rel), "rb") as f:
        return pq.read_table(f, columns=["sample_id"])["sample_id"].to_pylist()

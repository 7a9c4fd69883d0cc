"""The shard format: one Parquet file per actor batch, one row per sample, hidden states as bf16 bits.

Columns: sample_id string, input_ids list<int32>, loss_mask list<uint8>, num_tokens int32,
aux_hidden_states list<uint16> (row-major [T, K*H]), last_hidden_state list<uint16> ([T, H]).
The hidden-state leaf columns use BYTE_STREAM_SPLIT + zstd: bf16 bits split into byte planes compress
to ~0.70 of raw, losslessly, and any Parquet reader gets the bits back. Shape and layer ids live in the
schema metadata (key `hidden_harvest`) and in manifest.json; `open_shards` hides the encoding.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Iterator

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from pipeline.storage import Store

FORMAT_VERSION = 1
META_KEY = b"hidden_harvest"
SHARD_DIR = "shards"
HIDDEN_COLUMNS = ("aux_hidden_states", "last_hidden_state")


@dataclass(frozen=True)
class ShardLayout:
    aux_layers: tuple[int, ...]
    hidden_size: int
    encoding: str = "bss_zstd"
    zstd_level: int = 1
    last_rows: str = "all"  # "all" | "masked": rows of last_hidden_state kept

    @property
    def aux_width(self) -> int:
        return len(self.aux_layers) * self.hidden_size

    def metadata(self) -> dict:
        return {
            "format_version": FORMAT_VERSION,
            "aux_layers": list(self.aux_layers),
            "hidden_size": self.hidden_size,
            "aux_width": self.aux_width,
            "dtype": "bfloat16",
            "storage": "uint16 bit patterns, row-major",
            "encoding": self.encoding,
            "last_hidden_state_rows": self.last_rows,
        }

    def schema(self) -> pa.Schema:
        return pa.schema(
            [
                ("sample_id", pa.string()),
                ("input_ids", pa.list_(pa.int32())),
                ("loss_mask", pa.list_(pa.uint8())),
                ("num_tokens", pa.int32()),
                ("aux_hidden_states", pa.list_(pa.uint16())),
                ("last_hidden_state", pa.list_(pa.uint16())),
            ],
            metadata={META_KEY: json.dumps(self.metadata()).encode()},
        )


@dataclass
class CapturedSample:
    sample_id: str
    input_ids: list[int]
    loss_mask: list[int]
    aux: np.ndarray  # uint16 [T, K*H]
    last: np.ndarray  # uint16 [T, H]


def ids_digest(sample_ids: list[str]) -> str:
    """Order-independent digest of a set of sample ids: names shards and error files deterministically."""
    return hashlib.sha256("\n".join(sorted(sample_ids)).encode()).hexdigest()[:20]


def shard_name(sample_ids: list[str]) -> str:
    """Deterministic: the same set of samples always lands in the same file name."""
    return f"{SHARD_DIR}/part-{ids_digest(sample_ids)}.parquet"


def _flat_list(arrays: list[np.ndarray]) -> pa.ListArray:
    lengths = np.fromiter((a.size for a in arrays), dtype=np.int64, count=len(arrays))
    offsets = np.zeros(len(arrays) + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    values = np.concatenate([a.reshape(-1) for a in arrays]) if arrays else np.empty(0, np.uint16)
    return pa.LargeListArray.from_arrays(offsets, values).cast(pa.list_(pa.uint16()))


def _keep_rows(s: CapturedSample, layout: ShardLayout) -> np.ndarray:
    if layout.last_rows == "masked":
        return s.last[np.asarray(s.loss_mask, dtype=bool)]
    return s.last


def build_table(samples: list[CapturedSample], layout: ShardLayout) -> pa.Table:
    return pa.Table.from_arrays(
        [
            pa.array([s.sample_id for s in samples], pa.string()),
            pa.array([s.input_ids for s in samples], pa.list_(pa.int32())),
            pa.array([s.loss_mask for s in samples], pa.list_(pa.uint8())),
            pa.array([len(s.input_ids) for s in samples], pa.int32()),
            _flat_list([s.aux for s in samples]),
            _flat_list([_keep_rows(s, layout) for s in samples]),
        ],
        schema=layout.schema(),
    )


def write_shard(store: Store, samples: list[CapturedSample], layout: ShardLayout) -> tuple[str, int]:
    """Commit one shard atomically; returns (relative name, exact bytes committed)."""
    name = shard_name([s.sample_id for s in samples])
    table = build_table(samples, layout)
    with store.open_atomic(name) as f:
        pq.write_table(
            table,
            f,
            compression="zstd",
            compression_level=layout.zstd_level,
            use_dictionary=["sample_id"],
            # Must name the leaf paths: a top-level column name is silently ignored.
            use_byte_stream_split=[f"{c}.list.element" for c in HIDDEN_COLUMNS],
            write_statistics=["sample_id", "num_tokens"],
            row_group_size=max(1, len(samples)),
        )
    return name, store.size(name)


def read_layout(schema: pa.Schema) -> dict:
    meta = (schema.metadata or {}).get(META_KEY)
    if meta is None:
        raise ValueError("not a hidden-harvest shard: schema metadata has no `hidden_harvest` key")
    return json.loads(meta)


def _bf16(bits: np.ndarray):
    import torch

    return torch.from_numpy(np.ascontiguousarray(bits).view(np.int16).copy()).view(torch.bfloat16)


def decode_row(table: pa.Table, i: int, meta: dict, as_torch: bool = True, expand_last: bool = True) -> dict:
    """One sample: aux [T, K*H] and last [T, H] bf16 (torch) or uint16 bits (numpy), input_ids, loss_mask.

    Outputs written with last_hidden_state_rows="masked" store the final state only where loss_mask is 1:
    `last_hidden_state_positions` gives those positions; with expand_last (default) `last_hidden_state`
    is [T, H] with zeros elsewhere, without it the stored [M, H] rows.
    """
    n = table["num_tokens"][i].as_py()
    out = {"sample_id": table["sample_id"][i].as_py(), "num_tokens": n}
    ids = table["input_ids"][i].values.to_numpy(zero_copy_only=False)
    mask = table["loss_mask"][i].values.to_numpy(zero_copy_only=False)
    aux = table["aux_hidden_states"][i].values.to_numpy(zero_copy_only=False)
    last = table["last_hidden_state"][i].values.to_numpy(zero_copy_only=False)
    h = meta["hidden_size"]
    masked = meta.get("last_hidden_state_rows", "all") == "masked"
    last_rows = int(mask.sum()) if masked else n
    if aux.size != n * meta["aux_width"] or last.size != last_rows * h or ids.size != n or mask.size != n:
        raise ValueError(f"sample {out['sample_id']}: column sizes do not match {n} tokens")
    last = last.reshape(last_rows, h)
    if masked:
        positions = np.flatnonzero(mask)
        out["last_hidden_state_positions"] = positions
        if expand_last:
            full = np.zeros((n, h), dtype=np.uint16)
            full[positions] = last
            last = full
    aux = aux.reshape(n, -1)
    if as_torch:
        import torch

        out.update(input_ids=torch.from_numpy(ids.astype(np.int64)), loss_mask=torch.from_numpy(mask.copy()),
                   aux_hidden_states=_bf16(aux), last_hidden_state=_bf16(last))  # fmt: skip
        if masked:
            out["last_hidden_state_positions"] = torch.from_numpy(out["last_hidden_state_positions"])
    else:
        out.update(input_ids=ids, loss_mask=mask, aux_hidden_states=aux, last_hidden_state=last)
    return out


def list_shards(store: Store) -> list[str]:
    return store.list(SHARD_DIR, ".parquet")


def open_shards(path: str, as_torch: bool = True, expand_last: bool = True) -> Iterator[dict]:
    """Yield every committed sample under an output (local dir or s3://), shard by shard."""
    store = Store(path)
    for rel in list_shards(store):
        with store.fs.open(store.path(rel), "rb") as f:
            table = pq.read_table(f)
        meta = read_layout(table.schema)
        for i in range(table.num_rows):
            yield decode_row(table, i, meta, as_torch=as_torch, expand_last=expand_last)


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

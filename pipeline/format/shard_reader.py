"""Reading shards: one sample's columns decoded to bf16 (torch) or bf16 bits (numpy), the final layer given
after the norm unless asked for as stored; `open_shards` walks every committed sample of an output."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from pipeline.format.final_norm import FinalNorm
from pipeline.format.shard_layout import FINAL_LAYERS, codec_of, list_shards, read_layout, stored_final_layer
from pipeline.format.storage import Store


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

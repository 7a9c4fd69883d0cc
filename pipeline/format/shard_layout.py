"""What a shard is: its columns, the layout in its schema metadata, and its deterministic name.

The writer (pipeline/format/shard_writer.py) and the reader (pipeline/format/shard_reader.py) both follow
this; pipeline/format/shards.py describes the format and gathers the names other code imports.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass

import pyarrow as pa

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


def ids_digest(sample_ids: list[str]) -> str:
    """Order-independent digest of a set of sample ids: names shards and error files deterministically."""
    return hashlib.sha256("\n".join(sorted(sample_ids)).encode()).hexdigest()[:20]


def shard_name(sample_ids: list[str]) -> str:
    """Deterministic: the same set of samples always lands in the same file name."""
    return f"{SHARD_DIR}/part-{ids_digest(sample_ids)}.parquet"


def read_layout(schema: pa.Schema) -> dict:
    meta = (schema.metadata or {}).get(META_KEY)
    if meta is None:
        raise ValueError("not a hidden-harvest shard: schema metadata has no `hidden_harvest` key")
    return json.loads(meta)


def codec_of(meta: dict) -> Codec:
    """The codec a shard's metadata names (fp8 needs the block: the hidden size)."""
    return Codec(meta["encoding"], block=int(meta["hidden_size"]))


def stored_final_layer(meta: dict) -> str:
    """How a shard stores the final layer: format 3 says; formats 1 and 2 stored it after the norm."""
    return meta.get("final_layer", "post_norm")


def list_shards(store: Store) -> list[str]:
    return store.list(SHARD_DIR, ".parquet")

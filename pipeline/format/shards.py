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

What a shard is lives in pipeline/format/shard_layout.py, how one is written in shard_writer.py, how one is
read in shard_reader.py; this module gathers the names the rest of the project imports.
"""

from pipeline.format.shard_layout import (
    FINAL_LAYERS,
    FORMAT_VERSION,
    HIDDEN_COLUMNS,
    LAYOUT_DOC,
    META_KEY,
    SHARD_DIR,
    ShardLayout,
    codec_of,
    ids_digest,
    list_shards,
    read_layout,
    shard_name,
    stored_final_layer,
)
from pipeline.format.shard_reader import (
    decode_row,
    decode_sample,
    final_norm_of,
    hidden_bits,
    open_shards,
    read_token_columns,
    shard_sample_ids,
)
from pipeline.format.shard_writer import (
    ROW_GROUP_BYTES,
    EncodedSample,
    ShardWriter,
    build_table,
    encode_bits,
    encode_sample,
    write_shard,
)

__all__ = [
    "FINAL_LAYERS",
    "FORMAT_VERSION",
    "HIDDEN_COLUMNS",
    "LAYOUT_DOC",
    "META_KEY",
    "ROW_GROUP_BYTES",
    "SHARD_DIR",
    "EncodedSample",
    "ShardLayout",
    "ShardWriter",
    "build_table",
    "codec_of",
    "decode_row",
    "decode_sample",
    "encode_bits",
    "encode_sample",
    "final_norm_of",
    "hidden_bits",
    "ids_digest",
    "list_shards",
    "open_shards",
    "read_layout",
    "read_token_columns",
    "shard_name",
    "shard_sample_ids",
    "stored_final_layer",
    "write_shard",
]

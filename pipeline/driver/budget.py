"""Storage budget: estimate what a run will write before extraction starts, and refuse what cannot fit.

estimate = tokens x (aux layers + 1) x hidden x 2 bytes x the encoding's measured ratio to raw bf16
(bench/bench_storage.py, bench/results/data_path_h200.json). With last_hidden_state="masked" the final layer counts only masked tokens.
"""

from __future__ import annotations

import logging
import os
import shutil

from pipeline.format.shards import ShardLayout
from pipeline.format.storage import Store, human_bytes

logger = logging.getLogger(__name__)

# Measured stored/raw-bf16 ratio of each encoding on real hidden states, rounded up (bench/bench_storage.py,
# bench/results/data_path_h200.json; fp8: bench/bench_fp8.py, bench/results/fp8_default_model.json).
ENCODING_RATIO = {"planes_zstd": 0.71, "raw": 1.0, "fp8": 0.43}


class InsufficientSpace(RuntimeError):
    pass


def estimate_bytes(layout: ShardLayout, tokens: int, masked_tokens: int) -> int:
    final_rows = masked_tokens if layout.last_rows == "masked" else tokens
    raw = 2 * layout.hidden_size * (tokens * len(layout.aux_layers) + final_rows)
    return int(raw * ENCODING_RATIO[layout.encoding])


def free_bytes(store: Store) -> int | None:
    """Free space under a local output (its nearest existing parent); None for object storage."""
    if not store.local:
        return None
    path = os.path.abspath(store.root)
    while not os.path.exists(path):
        path = os.path.dirname(path)
    return shutil.disk_usage(path).free


def check_budget(store: Store, layout: ShardLayout, tokens: int, masked_tokens: int, enforce: bool) -> int:
    need = estimate_bytes(layout, tokens, masked_tokens)
    free = free_bytes(store)
    logger.info(
        "storage estimate: ~%s for %d tokens in output.encoding=%s (~%.2f of raw bf16)%s",
        human_bytes(need),
        tokens,
        layout.encoding,
        ENCODING_RATIO[layout.encoding],
        "" if free is None else f"; {human_bytes(free)} free at {store.display()}",
    )
    if enforce and free is not None and need > free:
        raise InsufficientSpace(
            f"this run needs ~{human_bytes(need)} at {store.display()} but only {human_bytes(free)} is free. "
            "Free space, point output.path elsewhere (local or s3://), store the final layer only where it is "
            "trained on (--set output.last_hidden_state=masked), or skip this check with "
            "--set output.check_free_space=false."
        )
    return need

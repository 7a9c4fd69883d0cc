"""What a run has to do: the tokenized input against the output's committed ids, decided in the ledger.

The driver never holds every id. The tokenized dataset's small columns stream into the ledger (ledger.py), the
committed ids stream in from the ids index (pipeline/format/ids_index.py), and DuckDB decides. What comes back:
exact counts for the plan line and the totals, the duplicates file (streamed to the output), and the keys of the
samples to skip, which go to Ray's object store in sorted chunks (`SkipList`): each filter task looks its block's
rows up there, so no set of ids is pickled into any task, and a fresh output has no filter at all.
"""

from __future__ import annotations

import hashlib
import logging
from dataclasses import dataclass

import numpy as np
import pyarrow as pa

from conf.schema import PlanConfig
from pipeline.driver.ledger import SAMPLE_COLUMNS, Ledger
from pipeline.format.errors import DUPLICATES, ErrorRow, write_errors
from pipeline.format.ids_index import IndexReport, committed_ids
from pipeline.format.storage import Store

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Work:
    """What this run has to do, decided from the tokenized input and the output's committed files."""

    samples: int  # tokenized samples in the input (a row may give several)
    input_rows: int
    duplicate_samples: int  # samples of rows whose ids repeat an earlier row's (skipped, written as filtered)
    committed_samples: int  # samples already committed (as data or as an error)
    rows: int  # samples to extract
    tokens: int
    masked: int  # their loss-masked tokens (the budget of a masked final state)
    conversations: dict  # extract.turns' choices and their cost
    skip: SkipList | None  # the samples not to run; None when there are none
    index: IndexReport  # how the committed ids were learned


def decide_work(tokenized, store: Store, policy: str, limits: PlanConfig | None = None) -> Work:
    """Stream the input's small columns and the committed ids into a ledger, decide, and write the duplicates
    file; the driver holds about one batch of `limits.batch_rows` rows at a time."""
    limits = limits or PlanConfig()
    batch_rows, read_threads = limits.batch_rows, limits.read_threads
    report = IndexReport()
    with Ledger(limits.ledger_dir, limits.ledger_memory_mb, limits.ledger_threads) as ledger:
        for batch in tokenized.select_columns(list(SAMPLE_COLUMNS)).iter_batches(
            batch_size=batch_rows, batch_format="pyarrow"
        ):
            ledger.add_samples(batch)
        for ids in committed_ids(store, read_threads, report):
            ledger.add_committed(ids)
        ledger.decide()
        counts = ledger.counts()
        if counts["duplicate_samples"]:
            # One line per skipped sample, like every other error file (a duplicated row may hold several turns).
            write_errors(
                store,
                DUPLICATES,
                (ErrorRow(sid, s, "filtered", "dedup", why) for s, sid, why in ledger.duplicate_rows(batch_rows)),
            )
        skip = SkipList.put(ledger.skip_keys(batch_rows)) if counts["rows"] < counts["samples"] else None
        return Work(
            samples=counts["samples"],
            input_rows=counts["input_rows"],
            duplicate_samples=counts["duplicate_samples"],
            committed_samples=counts["committed_samples"],
            rows=counts["rows"],
            tokens=counts["tokens"],
            masked=counts["masked"],
            conversations=conversation_plan(ledger.conversations(), policy),
            skip=skip,
            index=report,
        )


def conversation_plan(c: dict, policy: str) -> dict:
    """The ledger's conversation counts with the policy and the plan line's text."""
    plan = (
        f"extract.turns={policy}: {c['conversations']} conversations, {c['full']} rendered whole, {c['each']} "
        f"one sample per assistant turn; tokens {c['tokens_chosen']} (full would be {c['tokens_full']}, "
        f"each {c['tokens_each']})"
    )
    return {"turns": policy, **c, "plan": plan}


def skip_keys_of(sample_ids: list[str], sources: list[str]) -> np.ndarray:
    """uint64 [n, 2] keys of (sample_id, source) pairs, equal to the ledger's `skip_key_sql`."""
    digests = b"".join(
        hashlib.md5(f"{len(sid.encode())}:{sid}{src}".encode(), usedforsecurity=False).digest()
        for sid, src in zip(sample_ids, sources)
    )
    return np.frombuffer(digests, dtype="<u8").reshape(-1, 2).astype(np.uint64)


def _member(keys: np.ndarray, q: np.ndarray) -> np.ndarray:
    """Which rows of q ([m, 2]) are rows of keys ([n, 2], sorted by both columns): exact on all 128 bits."""
    hi = keys[:, 0]
    left = np.searchsorted(hi, q[:, 0], "left")
    right = np.searchsorted(hi, q[:, 0], "right")
    at = np.minimum(left, len(keys) - 1)
    hit = (left < right) & (keys[at, 1] == q[:, 1])
    # Two keys sharing their high 64 bits: look through the run (almost never taken).
    for i in np.flatnonzero((right - left > 1) & ~hit):
        hit[i] = bool((keys[left[i] : right[i], 1] == q[i, 1]).any())
    return hit


@dataclass(frozen=True)
class SkipList:
    """The sorted keys of the samples not to run, as chunks in Ray's object store (read zero-copy by every
    filter task on a node; the driver held one chunk at a time while putting them)."""

    chunks: tuple  # ObjectRefs of uint64 [n, 2] arrays, together sorted
    size: int

    @classmethod
    def put(cls, batches) -> SkipList:
        import ray

        chunks, size = [], 0
        for keys in batches:
            chunks.append(ray.put(keys))
            size += len(keys)
        return cls(tuple(chunks), size)

    def keep(self, block: pa.Table) -> pa.Table:
        """The rows of a block that are not in the list."""
        import ray

        if not block.num_rows:
            return block
        q = skip_keys_of(block["sample_id"].to_pylist(), block["source"].to_pylist())
        drop = np.zeros(len(q), dtype=bool)
        for keys in ray.get(list(self.chunks)):
            drop |= _member(keys, q)
        return block.filter(pa.array(~drop))


def _keep_block(block: pa.Table, skip: SkipList) -> pa.Table:
    return skip.keep(block)


def still_to_do(tokenized, skip: SkipList | None):
    """The samples neither committed nor a duplicate's, block by block; no filter at all when there are none."""
    if skip is None or not skip.size:
        return tokenized
    return tokenized.map_batches(_keep_block, fn_kwargs={"skip": skip}, batch_format="pyarrow", batch_size=None)

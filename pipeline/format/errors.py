"""errors/*.jsonl: one line per sample that is not stored as data, and why.

Every stage that rejects a sample (read, parse, tokenize, dedup, extract) says so with one ErrorRow; they
are written only through `write_errors` and read back only through `read_errors`, so the files of every
stage have the same keys and the totals count them the same way.
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from typing import Literal

from pipeline.format.storage import Store

ERROR_DIR = "errors"
# Rewritten by every run from the input; not a record of committed samples (see format/ids_index.committed_ids).
DUPLICATES = f"{ERROR_DIR}/duplicates.jsonl"
# Stages whose errors may pass on a second attempt (a server that died, a capture that failed validation);
# parse and tokenize errors are properties of the input and never change.
TRANSIENT_STAGES = ("engine", "extract")


@dataclass(frozen=True)
class ErrorRow:
    sample_id: str
    source: str  # the input file and line it came from
    status: Literal["error", "filtered"]  # filtered: left out on purpose (a duplicate), not a failure
    stage: str  # read | parse | tokenize | dedup | engine | extract
    reason: str

    def to_line(self) -> str:
        return json.dumps(asdict(self), ensure_ascii=False)

    @classmethod
    def from_line(cls, line: str) -> ErrorRow:
        d = json.loads(line)
        return cls(
            d["sample_id"], d.get("source", ""), d.get("status", "error"), d.get("stage", ""), d.get("reason", "")
        )

    @property
    def transient(self) -> bool:
        return self.stage in TRANSIENT_STAGES


def error_file(digest: str) -> str:
    """The error file of one actor batch: named like its shard, by the digest of the batch's sample ids."""
    return f"{ERROR_DIR}/part-{digest}.jsonl"


def write_errors(store: Store, rel: str, rows: Iterable[ErrorRow]) -> int:
    """One whole error file, committed at once (a reader never sees part of it) and written as the rows come
    (the duplicates of a large input are never all in memory); no rows removes it.
    Returns the bytes written (the ids index records them)."""
    rows = iter(rows)
    first = next(rows, None)
    if first is None:
        if store.exists(rel):
            store.remove(rel)
        return 0
    written = 0
    with store.open_atomic(rel) as f:
        for r in itertools.chain([first], rows):
            line = (r.to_line() + "\n").encode()
            f.write(line)
            written += len(line)
    return written


def error_files(store: Store) -> list[str]:
    """The committed error files; not DUPLICATES, which each run rewrites from its input."""
    return [rel for rel in store.list(ERROR_DIR, ".jsonl") if rel != DUPLICATES]


def read_errors(store: Store, rel: str) -> list[ErrorRow]:
    """The rows of one error file (blank lines skipped)."""
    return [ErrorRow.from_line(line) for line in store.read_bytes(rel).decode().splitlines() if line.strip()]


def reopen_transient_errors(store: Store) -> int:
    """Take the error rows of transient stages out of the committed error files, so their samples run again.

    Each error file is rewritten whole (or removed): after a crash at any point a sample is either still in
    errors/ or runs again, never both, and a sample that then succeeds is counted once, as ok.
    """
    reopened = 0
    for rel in error_files(store):
        rows = read_errors(store, rel)
        keep = [r for r in rows if not r.transient]
        if len(keep) != len(rows):
            reopened += len(rows) - len(keep)
            write_errors(store, rel, keep)
    return reopened

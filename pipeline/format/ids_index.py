"""index/*.parquet: which sample ids each committed shard and error file holds, so resume reads a few small files.

Reading the id column of every shard is two or more requests per shard on object storage: 10,000 shards are
minutes before the first batch. So each actor batch, after committing its error file and its shard, also puts
one small entry here naming both files with their sizes and ids. Resume lists shards/, errors/ and index/ once,
reads the entries in parallel, and trusts an entry's ids for a file only when the file is listed with the size
the entry recorded (and, for a shard, only when the ids hash to the shard's own name, which is the digest of its
ids). Every listed file no trusted entry covers (an entry that was never written, deleted, unreadable, or out of
date) has its ids read from the file itself: a stale or missing index costs time, never a wrong answer.

An entry is a table of rows (file, file_bytes, sample_id, status, num_tokens); one entry may cover any number of
files: the driver folds the batches' entries into checkpoints as the run goes (pipeline/driver/checkpoint.py), and
`compact` merges whatever an output holds into one (for outputs written before checkpoints; one entry is read
whole by one thread, so at a million ids checkpoints of a few hundred batches are faster to resume from).
"""

from __future__ import annotations

import io
import logging
import posixpath
import uuid
from collections.abc import Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import pyarrow as pa
import pyarrow.parquet as pq

from pipeline.format.errors import DUPLICATES, ERROR_DIR, read_errors
from pipeline.format.shards import SHARD_DIR, ids_digest
from pipeline.format.storage import Store

logger = logging.getLogger(__name__)

INDEX_DIR = "index"
ENTRY_SCHEMA = pa.schema(
    [
        ("file", pa.string()),  # the shard or error file, relative to the output
        ("file_bytes", pa.int64()),  # its size when committed: a file rewritten since no longer matches
        ("sample_id", pa.string()),
        ("status", pa.string()),  # ok (in the shard) | error | filtered (in the error file)
        ("num_tokens", pa.int32()),
    ]
)
# What resume gets back for every committed sample, from an entry or from the file itself.
IDS_SCHEMA = pa.schema([("sample_id", pa.string()), ("status", pa.string()), ("num_tokens", pa.int32())])


def entry_name(digest: str) -> str:
    """One batch's entry, named by the digest its error file is named by (all of the batch's ids)."""
    return f"{INDEX_DIR}/part-{digest}.parquet"


def _entry_bytes(table: pa.Table) -> bytes:
    sink = io.BytesIO()
    pq.write_table(table, sink, compression="zstd")
    return sink.getvalue()


def write_entry(store: Store, digest: str, files: Iterable[tuple[str, int, list[tuple[str, str, int]]]]) -> None:
    """Put one entry: for each committed (file, its size, [(sample_id, status, num_tokens)]). Written after
    the files it names, so an entry never names a file that was not committed."""
    cols: dict[str, list] = {f.name: [] for f in ENTRY_SCHEMA}
    for rel, size, rows in files:
        for sid, status, tokens in rows:
            for name, value in zip(ENTRY_SCHEMA.names, (rel, size, sid, status, tokens)):
                cols[name].append(value)
    if cols["file"]:
        store.write_bytes(entry_name(digest), _entry_bytes(pa.table(cols, schema=ENTRY_SCHEMA)))


@dataclass
class IndexReport:
    """How resume learned the committed ids: counts that say whether the index served."""

    entries: int = 0
    files: int = 0  # committed shard and error files listed
    from_index: int = 0  # files whose ids came from an entry
    read: list[str] = field(default_factory=list)  # files read because no entry could be trusted for them
    unreadable: int = 0  # entries that could not be read at all
    stale: int = 0  # (entry, file) pairs that disagree with the listing (file gone, other size, ids not its own)

    def line(self) -> str:
        return (
            f"committed ids: {self.files} files, {self.from_index} from {self.entries} index entries, "
            f"{len(self.read)} read from the files themselves ({self.stale} stale, {self.unreadable} unreadable entries)"
        )


def _listing(store: Store) -> dict[str, int]:
    """Every committed shard and error file with its size (DUPLICATES is rewritten by each run, not committed)."""
    files = store.list_sizes(SHARD_DIR, ".parquet")
    files.update((rel, n) for rel, n in store.list_sizes(ERROR_DIR, ".jsonl").items() if rel != DUPLICATES)
    return files


def _name_digest(rel: str) -> str:
    return posixpath.basename(rel).removeprefix("part-").rsplit(".", 1)[0]


def _read_entry(store: Store, rel: str) -> pa.Table | None:
    try:
        table = pq.read_table(io.BytesIO(store.read_bytes(rel)))
        # Grouped by file, so that a file's rows are judged together however the entry lists them.
        return table.select(ENTRY_SCHEMA.names).cast(ENTRY_SCHEMA).sort_by("file")
    except FileNotFoundError:
        return None  # removed since the listing (a compaction): its files are read or covered by another entry
    except Exception as e:  # noqa: BLE001 - any damage to an entry only means its files are read instead
        logger.warning("index entry %s cannot be read (%s); its files are read instead", store.display(rel), e)
        return None


def _trusted(table: pa.Table, listing: dict[str, int], report: IndexReport) -> Iterator[tuple[str, pa.Table]]:
    """(file, its rows) for every file of one entry that the listing confirms."""
    files = table["file"].to_pylist()
    bounds = [0] + [i for i in range(1, len(files)) if files[i] != files[i - 1]] + [len(files)]
    for start, end in zip(bounds, bounds[1:]):
        rel, part = files[start], table.slice(start, end - start)
        size = part["file_bytes"][0].as_py()
        statuses = set(part["status"].to_pylist())
        if rel.startswith(f"{SHARD_DIR}/"):
            # A shard's name is the digest of its ids: the entry's ids are checked without reading the shard.
            fits = statuses == {"ok"} and ids_digest(part["sample_id"].to_pylist()) == _name_digest(rel)
        else:
            fits = statuses <= {"error", "filtered"}
        if listing.get(rel) != size or not fits:
            report.stale += 1
            continue
        yield rel, part.select(IDS_SCHEMA.names)


def _read_file(store: Store, rel: str) -> pa.Table:
    """The ids a committed file holds, read from the file itself (no hidden states)."""
    if rel.startswith(f"{SHARD_DIR}/"):
        with store.fs.open(store.path(rel), "rb") as f:
            t = pq.read_table(f, columns=["sample_id", "num_tokens"])
        return pa.table(
            [t["sample_id"], pa.array(["ok"] * t.num_rows, pa.string()), t["num_tokens"].cast(pa.int32())],
            schema=IDS_SCHEMA,
        )
    rows = read_errors(store, rel)
    return pa.table(
        [[r.sample_id for r in rows], [r.status for r in rows], [0] * len(rows)],
        schema=IDS_SCHEMA,
    )


def committed_ids(store: Store, threads: int = 16, report: IndexReport | None = None) -> Iterator[pa.Table]:
    """Tables (sample_id, status, num_tokens) of every sample in a committed shard or error file.

    One listing of each folder, the index entries read `threads` at a time, then only the files no trusted
    entry covers. A file covered by two entries (a compaction cut short) is given once. Memory holds about
    `threads` entries or files at a time, never every id.
    """
    report = report if report is not None else IndexReport()
    listing = _listing(store)
    entries = store.list(INDEX_DIR, ".parquet")
    report.files, report.entries = len(listing), len(entries)
    covered: set[str] = set()
    with ThreadPoolExecutor(max(1, threads), thread_name_prefix="ids-index") as pool:
        for table in _bounded_map(pool, lambda rel: _read_entry(store, rel), entries, threads * 4):
            if table is None:
                report.unreadable += 1
                continue
            for rel, part in _trusted(table, listing, report):
                if rel not in covered:
                    covered.add(rel)
                    yield part
        report.from_index = len(covered)
        report.read = sorted(set(listing) - covered)
        yield from _bounded_map(pool, lambda rel: _read_file(store, rel), report.read, threads * 4)
    logger.info("%s", report.line())


def _bounded_map(pool: ThreadPoolExecutor, fn, items: list, window: int) -> Iterator:
    """pool.map in order with at most `window` results waiting (pool.map would start every item at once)."""
    pending: list = []
    for item in items:
        pending.append(pool.submit(fn, item))
        if len(pending) >= window:
            yield pending.pop(0).result()
    for fut in pending:
        yield fut.result()


def compact(store: Store, threads: int = 16) -> int:
    """Merge every entry that still matches the output into one, then remove the entries it replaces, so the
    next resume reads one file. Streamed entry by entry into the merged file: memory holds a few entries.

    Written first, removed after: a crash in between leaves entries that overlap, which readers tolerate.
    Returns the number of entries replaced.
    """
    before = store.list(INDEX_DIR, ".parquet")
    if len(before) <= 1:
        return 0
    listing = _listing(store)
    covered: set[str] = set()
    report = IndexReport()
    tmp = entry_name(f"compact-{uuid.uuid4().hex[:20]}")
    with (
        store.open_atomic(tmp) as f,
        pq.ParquetWriter(f, ENTRY_SCHEMA, compression="zstd") as writer,
        ThreadPoolExecutor(max(1, threads), thread_name_prefix="ids-index") as pool,
    ):
        for table in _bounded_map(pool, lambda rel: _read_entry(store, rel), before, threads * 4):
            for rel, part in _trusted(table, listing, report) if table is not None else ():
                if rel not in covered:
                    covered.add(rel)
                    n = part.num_rows
                    files = [pa.array([rel] * n, pa.string()), pa.array([listing[rel]] * n, pa.int64())]
                    writer.write_table(pa.table([*files, *part.columns], schema=ENTRY_SCHEMA))
    for rel in before:
        store.remove(rel)
    logger.info("index: %d entries merged into %s (%d files)", len(before), store.display(tmp), len(covered))
    return len(before)

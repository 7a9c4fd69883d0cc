"""The planner's ledger: every tokenized sample's small columns and the output's committed ids, on disk.

A million-row input is a few hundred MB of ids and sources; held as Python lists and sets in the driver it was
most of the driver's memory, and pickled into every filter task. Here they go into a DuckDB file in batches
(`add_samples`, `add_committed`); DuckDB finds the duplicates, joins with the committed ids and counts, within
its memory limit (it spills to its temporary directory beyond it). The driver then reads back only counts and
the few rows it writes (the duplicates file) or hands on (the keys of the samples to skip), batch by batch.

The rules are the job's (README, "Resume"): a row whose sample ids repeat those of an earlier row (by file, then
line number) is a duplicate and is skipped whole; a sample whose id is committed (as data or as an error) is
not run again.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
from collections.abc import Iterator

import numpy as np
import pyarrow as pa

logger = logging.getLogger(__name__)

SAMPLE_COLUMNS = ("sample_id", "source", "num_tokens", "num_masked", "turns", "cost_full", "cost_each", "unrendered")

# The (file, line) a source names, ordered as the job orders rows: `path:line` split at the last colon, a line
# that is not all digits counting as 0 (as Python's rpartition and isdigit would).
_PATH = "CASE WHEN contains(source, ':') THEN regexp_extract(source, '(?s)^(.*):[^:]*$', 1) ELSE '' END"
_LINE_TEXT = "CASE WHEN contains(source, ':') THEN regexp_extract(source, '(?s):([^:]*)$', 1) ELSE source END"
_LINE = f"CASE WHEN regexp_full_match({_LINE_TEXT}, '[0-9]+') THEN TRY_CAST({_LINE_TEXT} AS HUGEINT) ELSE 0 END"


def skip_key_sql() -> str:
    """A sample's 128-bit key from (sample_id, source) as two UBIGINTs; `skip_keys_of` computes the same in
    Python. The byte length prefix makes the encoding of the pair unambiguous."""
    text = "CAST(strlen(sample_id) AS VARCHAR) || ':' || sample_id || source"
    return f"md5_number_upper({text}) AS hi, md5_number_lower({text}) AS lo"


class Ledger:
    def __init__(self, directory: str | None = None, memory_limit_mb: int = 512, threads: int = 2):
        self.dir = tempfile.mkdtemp(prefix="harvest-ledger-", dir=directory)
        import duckdb

        self.con = duckdb.connect(
            os.path.join(self.dir, "ledger.duckdb"),
            config={
                "memory_limit": f"{memory_limit_mb}MB",
                "threads": threads,
                "temp_directory": os.path.join(self.dir, "spill"),
                # Order is given explicitly where it matters; without it DuckDB may stream and spill freely.
                "preserve_insertion_order": False,
            },
        )
        self.con.execute(
            "CREATE TABLE samples (seq BIGINT, sample_id VARCHAR, source VARCHAR, num_tokens BIGINT, "
            "num_masked BIGINT, turns VARCHAR, cost_full BIGINT, cost_each BIGINT, unrendered VARCHAR)"
        )
        self.con.execute("CREATE TABLE committed (sample_id VARCHAR)")
        self._seq = 0
        self._decided = False

    def close(self) -> None:
        self.con.close()
        shutil.rmtree(self.dir, ignore_errors=True)

    def __enter__(self) -> Ledger:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def add_samples(self, batch: pa.Table) -> None:
        """Tokenized samples in input order (their order within a row says which id names a duplicate)."""
        missing = [c for c in SAMPLE_COLUMNS if c not in batch.column_names]
        if missing:
            raise KeyError(f"the ledger needs columns {missing}, got {batch.column_names}")
        n = batch.num_rows
        seq = pa.array(np.arange(self._seq, self._seq + n, dtype=np.int64))
        self._seq += n
        b = batch.select(list(SAMPLE_COLUMNS)).add_column(0, "seq", seq)  # noqa: F841 - read by DuckDB by name
        self.con.execute("INSERT INTO samples SELECT * FROM b")

    def add_committed(self, batch: pa.Table) -> None:
        """Sample ids already committed in the output (as data or as an error)."""
        b = batch.select(["sample_id"])  # noqa: F841 - read by DuckDB by name
        self.con.execute("INSERT INTO committed SELECT * FROM b")

    def decide(self) -> None:
        """Mark each sample: its row a duplicate (with the reason), or its id already committed."""
        self.con.execute(
            f"""CREATE TABLE keyed AS SELECT seq, sample_id, source, {_PATH} AS path, {_LINE} AS line FROM samples"""
        )
        # The first source of each id, by (file, line), then input order for sources that tie.
        self.con.execute(
            """CREATE TABLE dups AS
            WITH firsts AS (
                SELECT sample_id, seq, source,
                       first_value(source) OVER (PARTITION BY sample_id ORDER BY path, line, seq) AS first_source
                FROM keyed)
            SELECT source, arg_min(sample_id, seq) AS sample_id, arg_min(first_source, seq) AS first_source
            FROM firsts WHERE source <> first_source GROUP BY source"""
        )
        self.con.execute("DROP TABLE keyed")
        self.con.execute(
            """CREATE TABLE decided AS
            SELECT s.seq, s.sample_id, s.source, s.num_tokens, s.num_masked,
                   d.source IS NOT NULL AS duplicate,
                   s.sample_id IN (SELECT sample_id FROM committed) AS committed
            FROM samples s LEFT JOIN dups d ON s.source = d.source"""
        )
        self._decided = True

    def counts(self) -> dict:
        """samples, input rows, duplicates (samples), committed (samples), rows to do, their tokens and masked."""
        self._need_decided()
        row = self.con.execute(
            """SELECT count(*), count(DISTINCT source),
                      count(*) FILTER (duplicate),
                      count(*) FILTER (committed AND NOT duplicate),
                      count(*) FILTER (NOT duplicate AND NOT committed),
                      coalesce(sum(num_tokens) FILTER (NOT duplicate AND NOT committed), 0),
                      coalesce(sum(num_masked) FILTER (NOT duplicate AND NOT committed), 0)
               FROM decided"""
        ).fetchall()[0]
        keys = ("samples", "input_rows", "duplicate_samples", "committed_samples", "rows", "tokens", "masked")
        return dict(zip(keys, (int(v) for v in row)))

    def duplicates(self) -> dict[str, str]:
        """source -> reason for every duplicated row (as many as there are duplicated rows: for tests and logs)."""
        self._need_decided()
        return {s: _reason(sid, first) for s, sid, first in self.con.execute("SELECT * FROM dups").fetchall()}

    def duplicate_rows(self, batch_rows: int = 65536) -> Iterator[tuple[str, str, str]]:
        """(source, sample_id, reason) of every sample of a duplicated row, ordered by source then id."""
        self._need_decided()
        cur = self.con.execute(
            """SELECT s.source, s.sample_id, d.sample_id, d.first_source
               FROM samples s JOIN dups d ON s.source = d.source ORDER BY s.source, s.sample_id"""
        )
        while rows := cur.fetchmany(batch_rows):  # to the empty fetch: DuckDB then frees the result
            for source, sid, dup_sid, first in rows:
                yield source, sid, _reason(dup_sid, first)

    def skip_keys(self, batch_rows: int = 1 << 20) -> Iterator[np.ndarray]:
        """The keys (uint64 [n, 2], sorted) of every sample not to run: a duplicate's, or already committed.
        Batches come in key order, so they concatenate into one sorted array."""
        self._need_decided()
        rel = self.con.sql(f"SELECT {skip_key_sql()} FROM decided WHERE duplicate OR committed ORDER BY hi, lo")
        for rb in rel.to_arrow_reader(batch_rows):
            if rb.num_rows:
                yield np.stack([rb.column(0).to_numpy(), rb.column(1).to_numpy()], axis=1).astype(np.uint64)

    def conversations(self) -> dict:
        """Per input row that is a conversation, extract.turns' choice and its cost; unrendered fields by name."""
        totals = self.con.execute(
            """SELECT count(*), count(*) FILTER (turns = 'full'), count(*) FILTER (turns = 'each'),
                      coalesce(sum(cost_full), 0), coalesce(sum(cost_each), 0),
                      coalesce(sum(CASE WHEN turns = 'full' THEN cost_full ELSE cost_each END), 0)
               FROM (SELECT source, any_value(turns) AS turns, any_value(cost_full) AS cost_full,
                            any_value(cost_each) AS cost_each
                     FROM samples WHERE coalesce(turns, '') <> '' GROUP BY source)"""
        ).fetchall()[0]
        unrendered = self.con.execute(
            """SELECT regexp_extract(f, '[^.]*$'), count(*) FROM (
                   SELECT unnest(string_split(unrendered, ',')) AS f FROM samples WHERE coalesce(unrendered, '') <> '')
               WHERE f <> '' GROUP BY 1 ORDER BY 1"""
        ).fetchall()
        keys = ("conversations", "full", "each", "tokens_full", "tokens_each", "tokens_chosen")
        return dict(zip(keys, (int(v) for v in totals))) | {"unrendered": {k: int(n) for k, n in unrendered}}

    def _need_decided(self) -> None:
        if not self._decided:
            raise RuntimeError("Ledger.decide() must run first")


def _reason(sid: str, first: str) -> str:
    return f"duplicate sample_id {sid!r} (first seen at {first})"

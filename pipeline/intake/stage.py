"""CPU stage between read and extract: every input row leaves as tokenized rows (one, or one per assistant turn), whatever it holds.

Lines the read stage could not decode become error rows here (stage `read`); every other line goes to
the tokenizer (pipeline/intake/tokenize.py). The tokenizer turns the bad rows it knows into error rows itself;
anything else it raises on one line (a 5,000-digit integer, JSON nested beyond the recursion limit, a bug)
becomes an error row for that line too, so one row can never abort the job or vanish from the totals.
"""

from __future__ import annotations

import logging

import pyarrow as pa

from pipeline.intake.normalize import bytes_id
from pipeline.intake.read import read_rows
from pipeline.intake.tokenize import TOKENIZED_SCHEMA, Tokenize

logger = logging.getLogger(__name__)

REQUIRED_COLUMNS = ("source", "line")


def error_row(sample_id: str, source: str, stage: str, reason: str) -> dict:
    return {
        "sample_id": sample_id,
        "source": source,
        "input_ids": [],
        "loss_mask": [],
        "num_tokens": 0,
        "num_masked": 0,
        "status": "error",
        "stage": stage,
        "reason": reason,
        "turns": "",
        "cost_full": 0,
        "cost_each": 0,
        "unrendered": "",
    }


def line_id(line: str) -> str:
    return bytes_id(line.encode("utf-8", "surrogatepass"))


class TokenizeLines:
    """map_batches stage (pyarrow in, pyarrow out): needs `source`, `line`; uses `read_error`, `read_id` when present."""

    def __init__(self, **tokenize_kwargs):
        self.tokenize = Tokenize(**tokenize_kwargs)

    def __call__(self, batch: pa.Table) -> pa.Table:
        missing = [c for c in REQUIRED_COLUMNS if c not in batch.column_names]
        if missing:
            raise KeyError(f"TokenizeLines needs columns {missing}, got {batch.column_names}")
        rows = []
        for source, line, read_error, read_id in read_rows(batch):
            if read_error:
                rows.append(error_row(read_id or line_id(source), source, "read", read_error))
            else:
                rows.extend(self._tokenize(source, line))
        return pa.Table.from_pylist(rows, schema=TOKENIZED_SCHEMA)

    def _tokenize(self, source: str, line: str) -> list[dict]:
        """The rows of one line: one, or one per assistant turn (extract.turns=each)."""
        try:
            return self.tokenize.tokenize_line(source, line)
        except Exception as e:  # noqa: BLE001 -- one row's failure is that row's error, never the job's
            logger.warning("%s: tokenizer raised %s", source, type(e).__name__)
            return [
                error_row(line_id(line), source, "tokenize", f"cannot be tokenized: {type(e).__name__}: {str(e)[:200]}")
            ]

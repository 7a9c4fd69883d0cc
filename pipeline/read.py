"""Stage 1: JSONL files (local or s3://, path or glob) -> rows of (source, line) through Ray Data.

Lines are kept as text so that a malformed line becomes an error row in the tokenize stage instead
of failing schema inference for the whole dataset. `source` is `file:line` for error reports.
"""

from __future__ import annotations

import logging

import fsspec

logger = logging.getLogger(__name__)


def expand_inputs(pattern: str) -> list[str]:
    fs, _ = fsspec.core.url_to_fs(pattern)
    matches = sorted(fs.glob(pattern)) if any(c in pattern for c in "*?[") else [pattern]
    if not matches or (len(matches) == 1 and not fs.exists(matches[0])):
        raise FileNotFoundError(f"input.path {pattern!r} matches no file")
    protocol = pattern.split("://", 1)[0] + "://" if "://" in pattern else ""
    return [m if m.startswith(protocol) else protocol + m for m in matches]


def read_lines(item: dict) -> list[dict]:
    url = item["path"]
    rows = []
    with fsspec.open(url, "rt", encoding="utf-8") as f:
        for lineno, line in enumerate(f, start=1):
            if line.strip():
                rows.append({"source": f"{url}:{lineno}", "line": line})
    return rows


def read_jsonl(pattern: str):
    import ray.data

    files = expand_inputs(pattern)
    logger.info("reading %d input file(s) from %s", len(files), pattern)
    return ray.data.from_items([{"path": u} for u in files]).flat_map(read_lines)


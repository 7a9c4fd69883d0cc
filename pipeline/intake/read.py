"""Stage 1: JSONL files (local or s3://, path or glob) -> rows of (source, line, read_error) through Ray Data.

Lines are read as bytes and decoded one by one, so a line that is not UTF-8 (or is too long to be a
sample) becomes one error row instead of failing the read of its whole file, and a malformed line becomes
an error row in the tokenize stage instead of failing schema inference for the whole dataset. `source` is
`file:line` for error reports; `read_error` is empty for a line that was read.
"""

from __future__ import annotations

import logging
from typing import IO

import fsspec

from pipeline.format.storage import storage_options
from pipeline.intake.normalize import bytes_id

logger = logging.getLogger(__name__)

# Default of input.max_line_bytes. A longer line is not read into memory: no sample under any sane max_tokens
# is near it (2M tokens of text is ~10 MB), and one huge line must not take the reading task's memory with it.
MAX_LINE_BYTES = 64 * 2**20
_CHUNK = 2**20
_BOM = b"\xef\xbb\xbf"


def expand_inputs(pattern: str) -> list[str]:
    fs, _ = fsspec.core.url_to_fs(pattern, **storage_options(pattern))
    matches = sorted(fs.glob(pattern)) if any(c in pattern for c in "*?[") else [pattern]
    if not matches or (len(matches) == 1 and not fs.exists(matches[0])):
        raise FileNotFoundError(f"input.path {pattern!r} matches no file")
    protocol = pattern.split("://", 1)[0] + "://" if "://" in pattern else ""
    return [m if m.startswith(protocol) else protocol + m for m in matches]


def _lines(f: IO[bytes], limit: int):
    """(line bytes or None when over `limit`, its length in bytes) for every line; memory bounded by `limit`.

    Reads fixed-size chunks (object-store files have no readline(size)); a line over the limit is counted
    and skipped, never held.
    """
    buf = bytearray()
    skipped = -1  # bytes of the over-long line being skipped; -1 while the current line fits
    while chunk := f.read(_CHUNK):
        start = 0
        while start < len(chunk):
            nl = chunk.find(b"\n", start)
            end = len(chunk) if nl < 0 else nl + 1
            if skipped >= 0:
                skipped += end - start
            else:
                buf += chunk[start:end]
                if len(buf) > limit:
                    skipped = len(buf)
                    buf = bytearray()
            start = end
            if nl >= 0:
                yield (None, skipped) if skipped >= 0 else (bytes(buf), len(buf))
                buf, skipped = bytearray(), -1
    if skipped >= 0:
        yield None, skipped
    elif buf:
        yield bytes(buf), len(buf)


def decode_line(raw: bytes | None, size: int, limit: int = MAX_LINE_BYTES) -> tuple[str, str]:
    """(text, "") for a readable line, ("", reason) for one that cannot be read as text."""
    if raw is None:
        return "", f"line is {size:,} bytes, over the {limit:,}-byte limit for one sample"
    try:
        return raw.decode("utf-8"), ""
    except UnicodeDecodeError as e:
        return "", f"not valid UTF-8: byte 0x{raw[e.start]:02x} at byte offset {e.start} of the line"


def read_lines(item: dict, limit: int = MAX_LINE_BYTES) -> list[dict]:
    url = item["path"]
    rows = []
    with fsspec.open(url, "rb", **storage_options(url)) as f:
        for lineno, (raw, size) in enumerate(_lines(f, limit), start=1):
            if raw is not None:
                if lineno == 1 and raw.startswith(_BOM):  # editors on some systems start UTF-8 files with a BOM
                    raw = raw[len(_BOM) :]
                if not raw.strip():
                    continue
            text, error = decode_line(raw, size, limit)
            # Content id of what could not be read, so its error row is traceable and stable across reruns.
            rid = bytes_id(raw or f"{url}:{lineno}".encode()) if error else ""
            rows.append({"source": f"{url}:{lineno}", "line": text, "read_error": error, "read_id": rid})
    if not rows:
        logger.warning("input file %s holds no rows", url)
    return rows


def read_rows(batch):
    """(source, line, read_error, read_id) of each row of a pyarrow batch of read lines; the error columns may be
    absent (a batch made without them), and then every row reads as read cleanly."""
    n = batch.num_rows
    errors = batch["read_error"].to_pylist() if "read_error" in batch.column_names else [""] * n
    ids = batch["read_id"].to_pylist() if "read_id" in batch.column_names else [""] * n
    return zip(batch["source"].to_pylist(), batch["line"].to_pylist(), errors, ids)


def read_jsonl(pattern: str, max_line_bytes: int = MAX_LINE_BYTES):
    import ray.data

    files = expand_inputs(pattern)
    logger.info("reading %d input file(s) from %s", len(files), pattern)
    return ray.data.from_items([{"path": u} for u in files]).flat_map(read_lines, fn_kwargs={"limit": max_line_bytes})

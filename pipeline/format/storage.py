"""Local directories and s3:// prefixes behind one small interface, with atomic commits.

A file is committed whole or not at all: locally it is written under a hidden temporary name in the
same directory and renamed; on object storage the object only exists once its upload completes.
Credentials and endpoints come from the standard AWS environment/config and are never logged.
"""

from __future__ import annotations

import contextlib
import copy
import logging
import os
import posixpath
import re
import tempfile
import uuid
from collections.abc import Iterator
from typing import IO

import fsspec

from pipeline import envs

logger = logging.getLogger(__name__)

TMP_PREFIX = ".tmp-"

# Object-store calls retry transient failures (5xx, throttling, dropped or refused connections) with
# exponential backoff and jitter (botocore's standard mode), then fail: a run never hangs on a vanished
# endpoint, and a brief outage costs nothing. s3fs retries a few error kinds on top (S3FileSystem.retries).
S3_OPTIONS = {
    "config_kwargs": {"retries": {"max_attempts": 4, "mode": "standard"}, "connect_timeout": 10, "read_timeout": 120},
}
_SECRET_ENV = tuple(v.name for v in envs.AWS_SECRETS)


def storage_options(url: str) -> dict:
    # A deep copy each time: botocore rewrites the retries dict it is given in place
    # (max_attempts -> total_max_attempts), which would leak into every later filesystem.
    return copy.deepcopy(S3_OPTIONS) if url.startswith(("s3://", "s3a://")) else {}


def redact(text: str) -> str:
    """Text with credentials blanked: values of the AWS secret variables and any user:password@ in a URL."""
    for name in _SECRET_ENV:
        value = os.environ.get(name)
        if value and len(value) >= 4:
            text = text.replace(value, "***")
    return re.sub(r"://[^/@\s]+@", "://***@", text)


class Store:
    def __init__(self, url: str):
        self.url = url.rstrip("/")
        self.fs, self.root = fsspec.core.url_to_fs(self.url, **storage_options(self.url))
        protocols = self.fs.protocol if isinstance(self.fs.protocol, tuple) else (self.fs.protocol,)
        self.local = "file" in protocols

    def path(self, rel: str) -> str:
        return posixpath.join(self.root, rel) if rel else self.root

    def display(self, rel: str = "") -> str:
        return posixpath.join(self.url, rel) if rel else self.url

    @contextlib.contextmanager
    def open_atomic(self, rel: str) -> Iterator[IO[bytes]]:
        """Write `rel`; readers see the whole file or nothing (no partial file is ever visible)."""
        final = self.path(rel)
        parent = posixpath.dirname(final)
        if self.local:
            os.makedirs(parent, exist_ok=True)
            tmp = posixpath.join(parent, f"{TMP_PREFIX}{uuid.uuid4().hex}-{posixpath.basename(final)}")
            try:
                with open(tmp, "wb") as f:
                    yield f
                _durable_rename(tmp, final)
            finally:
                if os.path.exists(tmp):
                    os.remove(tmp)
        else:
            # An S3 object appears only when its (multipart) upload completes on close.
            with self.fs.open(final, "wb") as f:
                yield f

    def stage(self, rel_dir: str) -> str:
        """A local temporary file to build a file whose name is known only at the end (commit_staged)."""
        if self.local:
            parent = self.path(rel_dir)
            os.makedirs(parent, exist_ok=True)
        else:
            parent = tempfile.gettempdir()
        return posixpath.join(parent, f"{TMP_PREFIX}{uuid.uuid4().hex}")

    def commit_staged(self, tmp: str, rel: str) -> None:
        """Make a staged file visible under `rel` whole: fsync + rename locally, one upload to object storage."""
        try:
            if self.local:
                _durable_rename(tmp, self.path(rel))
            else:
                self.fs.put_file(tmp, self.path(rel))
        finally:
            if os.path.exists(tmp):
                os.remove(tmp)

    def write_bytes(self, rel: str, data: bytes) -> None:
        with self.open_atomic(rel) as f:
            f.write(data)

    def read_bytes(self, rel: str) -> bytes:
        return self.fs.cat_file(self.path(rel))

    def exists(self, rel: str) -> bool:
        return self.fs.exists(self.path(rel))

    def list(self, rel_dir: str, suffix: str = "") -> list[str]:
        """Committed files under rel_dir (relative names, sorted); temporaries are not listed."""
        base = self.path(rel_dir)
        try:
            # refresh: s3fs caches listings, and resume must see shards committed since.
            entries = self.fs.ls(base, detail=False) if self.local else self.fs.ls(base, detail=False, refresh=True)
        except FileNotFoundError:
            return []
        names = sorted(posixpath.basename(e.rstrip("/")) for e in entries)
        return [posixpath.join(rel_dir, n) for n in names if n.endswith(suffix) and not n.startswith(TMP_PREFIX)]

    def list_sizes(self, rel_dir: str, suffix: str = "") -> dict[str, int]:
        """Committed files under rel_dir with their sizes, from one listing (no request per file)."""
        base = self.path(rel_dir)
        try:
            entries = self.fs.ls(base, detail=True) if self.local else self.fs.ls(base, detail=True, refresh=True)
        except FileNotFoundError:
            return {}
        sizes = {}
        for e in entries:
            name = posixpath.basename(e["name"].rstrip("/"))
            if e.get("type") != "directory" and name.endswith(suffix) and not name.startswith(TMP_PREFIX):
                sizes[posixpath.join(rel_dir, name)] = int(e["size"])
        return dict(sorted(sizes.items()))

    def size(self, rel: str) -> int:
        return int(self.fs.size(self.path(rel)))

    def remove(self, rel: str) -> None:
        self.fs.rm(self.path(rel))

    def clean_temporaries(self, rel_dir: str) -> int:
        """Remove temporary files a crashed run left behind (local only; S3 has no partial objects)."""
        if not self.local:
            return 0
        base = self.path(rel_dir)
        if not os.path.isdir(base):
            return 0
        stale = [n for n in os.listdir(base) if n.startswith(TMP_PREFIX)]
        for n in stale:
            os.remove(os.path.join(base, n))
        if stale:
            logger.info("removed %d temporary files left by an earlier run in %s", len(stale), self.display(rel_dir))
        return len(stale)


def _durable_rename(tmp: str, final: str) -> None:
    """fsync, then rename: the file is durable before it becomes visible under its final name."""
    fd = os.open(tmp, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, final)


def human_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        # Compare the value as printed, so 999,999 B reads "1.00 MB" and not "1,000.00 KB".
        if round(abs(n), 2 if unit != "B" else 0) < 1000 or unit == "TB":
            return f"{n:,.0f} {unit}" if unit == "B" else f"{n:,.2f} {unit}"
        n /= 1000.0
    return f"{n:.2f} TB"

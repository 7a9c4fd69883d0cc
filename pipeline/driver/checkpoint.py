"""The driver's side of the ids index: fold the batches' entries into few while the run goes on.

Each actor batch puts its own index entry; after 10,000 batches that is 10,000 requests for the next resume on
object storage. The driver already receives every committed sample's metadata row (id, status, tokens, its share
of its shard's bytes, which add up exactly to the shard's size, and the size of its batch's error file), so every
`every` batches it puts one entry for those batches' files from what it holds, and then removes the batches' own
entries. A run killed at any point leaves at most `every` batches' entries beside a few checkpoints, and every
entry that is there is right (pipeline/format/ids_index.py): the checkpoint is written before the entries it
replaces are removed.
"""

from __future__ import annotations

import logging
import os

from pipeline.format.errors import error_file
from pipeline.format.ids_index import entry_name, write_entry
from pipeline.format.shards import ids_digest
from pipeline.format.storage import Store

logger = logging.getLogger(__name__)


class IndexCheckpoint:
    def __init__(self, store: Store, every: int = 256):
        self.store, self.every = store, max(1, every)
        self._files: dict[str, list] = {}  # shard or error file -> [bytes, [(sample_id, status, tokens)]]
        self._redundant: list[str] = []  # the batches' own entries, covered once the checkpoint is written
        self.written = 0

    def add_batch(
        self,
        ids: list[str],
        statuses: list[str],
        tokens: list[int],
        nbytes: list[int],
        shards: list[str],
        errors_bytes: int,
    ) -> None:
        """One actor batch's metadata rows, as the extractor returned them."""
        digest = ids_digest(ids)
        for sid, status, n, b, shard in zip(ids, statuses, tokens, nbytes, shards):
            if status == "ok" and shard:
                entry = self._files.setdefault(shard, [0, []])
                entry[0] += b
                entry[1].append((sid, "ok", n))
            elif status != "ok":
                self._files.setdefault(error_file(digest), [errors_bytes, []])[1].append((sid, status, 0))
        self._redundant.append(entry_name(digest))
        if len(self._redundant) >= self.every:
            self.flush()

    def flush(self) -> None:
        if not self._files:
            return
        files = [(rel, size, rows) for rel, (size, rows) in sorted(self._files.items())]
        write_entry(self.store, f"ckpt-{ids_digest(sorted(self._files))}", files)
        self.written += 1
        paths = [self.store.path(rel) for rel in self._redundant]
        if self.store.local:
            for path in paths:
                try:
                    os.remove(path)
                except FileNotFoundError:
                    pass  # a batch whose entry was never written
        else:
            self.store.fs.rm(paths)  # one request per 1,000 keys; a key already gone is no error
        self._files, self._redundant = {}, []

"""The driver's side of the ids index: fold the batches' entries into few while the run goes on.

Each actor batch puts its own index entry; after 10,000 batches that is 10,000 requests for the next resume on
object storage. The driver already receives every committed sample's metadata row (id, status, tokens, its share
of its shard's bytes, which add up exactly to the shard's size), so every `every` shards it puts one entry for
those shards from what it holds, and then removes the batches' own entries that it made redundant (those of
batches without an error file: the driver does not know an error file's size, so those entries stay). A run
killed at any point leaves at most `every` batches' entries beside a few checkpoints, and every entry that is
there is right (pipeline/format/ids_index.py): the checkpoint is written before the entries it replaces are
removed.
"""

from __future__ import annotations

import logging

from pipeline.format.ids_index import entry_name, write_entry
from pipeline.format.shards import ids_digest
from pipeline.format.storage import Store

logger = logging.getLogger(__name__)


class IndexCheckpoint:
    def __init__(self, store: Store, every: int = 256):
        self.store, self.every = store, max(1, every)
        self._shards: dict[str, list] = {}  # shard -> [bytes, [(sample_id, "ok", tokens)]]
        self._redundant: list[str] = []  # entries of batches wholly covered once the checkpoint is written
        self.written = 0

    def add_batch(self, ids: list[str], statuses: list[str], tokens: list[int], nbytes: list[int], shards: list[str]):
        """One actor batch's metadata rows, as the extractor returned them."""
        for sid, status, n, b, shard in zip(ids, statuses, tokens, nbytes, shards):
            if status == "ok" and shard:
                entry = self._shards.setdefault(shard, [0, []])
                entry[0] += b
                entry[1].append((sid, "ok", n))
        if all(s == "ok" for s in statuses):  # no error file: the checkpoint covers the whole batch
            self._redundant.append(entry_name(ids_digest(ids)))
        if len(self._shards) >= self.every:
            self.flush()

    def flush(self) -> None:
        if not self._shards:
            return
        files = [(shard, size, rows) for shard, (size, rows) in sorted(self._shards.items())]
        write_entry(self.store, f"ckpt-{ids_digest(sorted(self._shards))}", files)
        self.written += 1
        gone = [self.store.path(rel) for rel in self._redundant]
        try:
            if gone:
                self.store.fs.rm(gone)
        except FileNotFoundError:
            pass  # already merged away; what is left over is only read twice, never counted twice
        self._shards, self._redundant = {}, []

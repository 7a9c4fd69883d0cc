"""Reading an output for training: a torch IterableDataset, and the same decode over Ray Data batches.

`HiddenStatesDataset(output)` yields one sample at a time as torch tensors: input_ids int64 [T], loss_mask
uint8 [T], aux_hidden_states bf16 [T, K*H], last_hidden_state bf16 [T, H] (after the final norm, or before
it with final="pre_norm"), sample_id. Each epoch, the output's units of work (a shard, or a row range of
one when there are more readers than shards) are shuffled with the seed and the epoch, dealt round-robin
to every reader (distributed rank x DataLoader worker), read ahead on a thread, and passed through a
seeded shuffle buffer: every sample is seen exactly once per epoch across all readers. With `pack_to`,
samples are concatenated into rows of at most that many tokens (`lengths` says where each one starts;
a longer sample is a row of its own, never cut).

`BatchDecoder(output)` decodes a batch of `ray.data.read_parquet(f"{output}/shards")` (numpy format) into
the same per-sample dicts, for a Ray Train loop.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import pyarrow.parquet as pq

from pipeline.format.shards import codec_of, decode_row, decode_sample, list_shards, read_layout
from pipeline.format.storage import Store

logger = logging.getLogger(__name__)

try:  # the loader is a torch dataset; the rest of the package does not need torch at import
    from torch.utils.data import IterableDataset, get_worker_info
except ImportError:  # pragma: no cover
    IterableDataset = object  # type: ignore[misc,assignment]

    def get_worker_info():  # type: ignore[misc]
        return None


@dataclass(frozen=True)
class Unit:
    shard: str
    start: int
    stop: int


def _readers(rank: int | None, world_size: int | None) -> tuple[int, int]:
    """(this reader's index, readers in all): distributed rank x DataLoader worker."""
    if rank is None or world_size is None:
        try:
            import torch.distributed as dist

            if dist.is_available() and dist.is_initialized():
                rank, world_size = dist.get_rank(), dist.get_world_size()
        except ImportError:  # pragma: no cover
            pass
    rank, world_size = rank or 0, world_size or 1
    info = get_worker_info()
    wid, nw = (info.id, info.num_workers) if info is not None else (0, 1)
    return rank * nw + wid, world_size * nw


class HiddenStatesDataset(IterableDataset):
    def __init__(
        self,
        output: str,
        final: str = "post_norm",
        shuffle: bool = True,
        seed: int = 0,
        buffer_size: int = 256,
        pack_to: int | None = None,
        prefetch: int = 2,
        rank: int | None = None,
        world_size: int | None = None,
    ):
        self.output, self.final = output, final
        self.shuffle, self.seed, self.buffer_size = shuffle, seed, max(1, buffer_size)
        self.pack_to, self.prefetch = pack_to, max(1, prefetch)
        self.rank, self.world_size = rank, world_size
        self.epoch = 0
        store = Store(output)
        self._rows = {}
        for rel in list_shards(store):
            with store.fs.open(store.path(rel), "rb") as f:
                self._rows[rel] = pq.ParquetFile(f).metadata.num_rows

    def set_epoch(self, epoch: int) -> None:
        """Another order for the next pass (as DistributedSampler.set_epoch): call before each epoch."""
        self.epoch = epoch

    def __len__(self) -> int:
        return sum(self._rows.values())

    def units(self, readers: int) -> list[Unit]:
        """The epoch's units in order: whole shards, split into row ranges when readers outnumber shards."""
        total = len(self)
        shards = sorted(self._rows)
        per = max(1, -(-total // readers)) if readers > len(shards) else max(self._rows.values(), default=1)
        units = [Unit(rel, a, min(a + per, n)) for rel in shards for n in [self._rows[rel]] for a in range(0, n, per)]
        if self.shuffle:
            order = np.random.default_rng([self.seed, self.epoch]).permutation(len(units))
            units = [units[i] for i in order]
        return units

    def _read(self, units: list[Unit], out: queue.Queue, stop: threading.Event) -> None:
        store = Store(self.output)
        try:
            for u in units:
                with store.fs.open(store.path(u.shard), "rb") as f:
                    table = pq.read_table(f)
                meta = read_layout(table.schema)
                samples = [decode_row(table, i, meta, final=self.final) for i in range(u.start, u.stop)]
                while not stop.is_set():
                    try:
                        out.put(samples, timeout=0.1)
                        break
                    except queue.Full:
                        continue
                if stop.is_set():
                    return
        except BaseException as e:  # noqa: BLE001 -- handed to the consumer, raised there
            out.put(e)
            return
        out.put(None)

    def _samples(self) -> Iterator[dict]:
        me, readers = _readers(self.rank, self.world_size)
        mine = self.units(readers)[me::readers]
        q: queue.Queue = queue.Queue(maxsize=self.prefetch)
        stop = threading.Event()
        reader = threading.Thread(target=self._read, args=(mine, q, stop), name="hidden-states-reader", daemon=True)
        reader.start()
        rng = np.random.default_rng([self.seed, self.epoch, me])
        buffer: list[dict] = []
        try:
            while True:
                item = q.get()
                if item is None:
                    break
                if isinstance(item, BaseException):
                    raise item
                for s in item:
                    if not self.shuffle:
                        yield s
                        continue
                    buffer.append(s)
                    if len(buffer) >= self.buffer_size:
                        yield buffer.pop(int(rng.integers(len(buffer))))
            while buffer:
                yield buffer.pop(int(rng.integers(len(buffer))))
        finally:
            stop.set()

    def __iter__(self) -> Iterator[dict]:
        samples = self._samples()
        return samples if self.pack_to is None else pack(samples, self.pack_to)


def pack(samples, max_tokens: int) -> Iterator[dict]:
    """Consecutive samples concatenated into rows of at most max_tokens tokens; `lengths` [n] and `sample_ids`
    say what each row holds. A sample longer than max_tokens is a row of its own (never cut)."""
    import torch

    keys = ("input_ids", "loss_mask", "aux_hidden_states", "last_hidden_state")
    row: list[dict] = []

    def emit():
        out = {k: torch.cat([s[k] for s in row]) for k in keys}
        out["lengths"] = torch.tensor([s["num_tokens"] for s in row])
        out["sample_ids"] = [s["sample_id"] for s in row]
        return out

    used = 0
    for s in samples:
        if row and used + s["num_tokens"] > max_tokens:
            yield emit()
            row, used = [], 0
        row.append(s)
        used += s["num_tokens"]
    if row:
        yield emit()


class BatchDecoder:
    """Decodes a numpy-format batch of `ray.data.read_parquet(f"{output}/shards")` into per-sample dicts
    (torch tensors), as `open_shards` gives them. The layout comes from the output's first shard: every
    shard of an output has the same one (`harvest verify` checks it)."""

    def __init__(self, output: str, final: str = "post_norm", as_torch: bool = True):
        store = Store(output)
        shards = list_shards(store)
        if not shards:
            raise ValueError(f"{store.display()} has no committed shards")
        with store.fs.open(store.path(shards[0]), "rb") as f:
            self.meta = read_layout(pq.read_schema(f))
        if self.meta.get("format_version", 1) < 2:
            raise ValueError("format-1 outputs store hidden states as lists: read them with open_shards")
        self.codec = codec_of(self.meta)
        self.final, self.as_torch = final, as_torch

    def __call__(self, batch: dict) -> list[dict]:
        out = []
        for i in range(len(batch["sample_id"])):

            def hidden(column, rows, width, i=i):
                return self.codec.decode_bits(batch[column][i], rows, width)

            out.append(
                decode_sample(
                    str(batch["sample_id"][i]),
                    np.asarray(batch["input_ids"][i]),
                    np.asarray(batch["loss_mask"][i]),
                    int(batch["num_tokens"][i]),
                    hidden,
                    self.meta,
                    self.as_torch,
                    True,
                    self.final,
                )
            )
        return out

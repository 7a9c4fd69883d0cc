"""Publishes per-request hidden-state dumps from an SGLang forward without stalling it (version-independent).

On the forward path (``DumpPublisher.capture``) only device work is queued, on the current stream: the
non-finite count per row and each request's bf16 bits rearranged into byte planes [2, W, T] (the layout the
shard codec stores, pipeline/format/codec.py) in one staging tensor. One asynchronous copy of it into a reused
pinned host buffer then runs on a side stream (the copy engine), followed by an event. The GPU never waits
for the host and the forward stream never waits for the copy. A writer thread waits for the event and
publishes one file per request, ``<rid>.hhd`` (temporary name, then rename: a reader never sees a partial
dump). A request prefilled in chunks is assembled in the writer thread and published after its last chunk
(the client puts the prompt length in the rid). Lifetimes: the model's tensors are read only by kernels on
the forward stream, before ``capture`` returns; the staging tensor is marked as used by the copy stream
(record_stream), so the caching allocator reuses it only after the copy; a host buffer is reused only after
the writer has published everything in it (two buffers: one filling while the other is written out).

Dump layout: 8-byte little-endian header length, a JSON header, the aux body and the final layer's body.
Layout `planes` (bf16 outputs): byte planes [2, K*H, T] and [2, H, T] (uint8; plane 0 low bytes,
channel-major). Layout `fp8` (``HIDDEN_HARVEST_LAYOUT=fp8``, for an fp8 output): quantized here, on the
device, so the actor only compresses: per column, float32 scales [B, T] (one per token per H-wide layer
block: amax / 448 rounded up to a bf16 value, 1 for an all-zero block), then the e4m3fn values [W, T],
channel-major. The header carries the sha256 of the input ids as
the server saw them, the prefix length the server reused and the non-finite count, so the client can prove
the dump belongs to what it sent, is complete and holds finite values without reading the data.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import queue
import struct
import threading
from dataclasses import dataclass

# Host buffers per server: one being filled by the GPU while the writer publishes the other.
_HOST_SLOTS = 2
_FP8_MAX = 448.0  # the largest finite float8_e4m3fn

logger = logging.getLogger("hidden_harvest_hook")


@dataclass
class _Request:
    rid: str
    row: int  # first row in the batch
    n: int
    prefix_len: int
    offset: int  # of its planes in the host buffer


@dataclass
class _Job:
    slot: int
    event: object  # torch.cuda.Event, or None on CPU (the copy already happened)
    rows: int
    nbytes: int  # of the host buffer in use
    requests: list[_Request]
    aux_width: int
    hidden_size: int
    source_dtype: str
    final_layer: str = "post_norm"  # what the final planes hold: the norm's output, or its input (pre_norm)
    layout: str = "planes"


def body_bytes(layout: str, width: int, hidden: int, n: int) -> int:
    """A column's body for n tokens: two bytes a value (planes), or a float32 scale per block and a byte a value."""
    return 2 * width * n if layout == "planes" else (4 * (width // hidden) + width) * n


def segments(layout: str, width: int, hidden: int) -> list:
    """A column's body as channel-major parts (rows, bytes per token per row): a chunk of tokens is a column
    range of each."""
    return [(2 * width, 1)] if layout == "planes" else [(width // hidden, 4), (width, 1)]


def _blocks(aux) -> list:
    """The aux capture as column blocks [T, w_i]: a list of K [T, H] tensors, or one packed [T, K*H]."""
    return list(aux) if isinstance(aux, (list, tuple)) else [aux]


def _bf16_rows(x, rows: slice):
    import torch

    x = x[rows]
    return x if x.dtype == torch.bfloat16 else x.to(torch.bfloat16)


def _quantize_fp8(dst, x, rows: slice, hidden: int) -> None:
    """dst (uint8, the body of x[rows]'s blocks: float32 scales [B, n], then e4m3 [B*H, n]) = x[rows] ([n, B*H])
    quantized per token per H-wide block. The math runs where x is (the forward's device)."""
    import torch

    x = x[rows]
    n, w = x.shape
    b = w // hidden
    blocks = x.view(n, b, hidden).float()
    amax = blocks.abs().amax(-1)
    # amax / 448 rounded up to a bf16 value, on its float32 bits: the project's codec computes the same.
    s = (amax / _FP8_MAX).contiguous()
    u = s.view(torch.int32)
    up = torch.where((u & 0xFFFF) != 0, (u + 0x10000) & -0x10000, u).view(torch.float32)
    scale = torch.where(amax > 0, up, torch.ones_like(up))
    # Clamped: torch's cast to e4m3fn does not saturate (an infinite input would become NaN, not 448).
    q = (blocks / scale.unsqueeze(-1)).clamp_(-_FP8_MAX, _FP8_MAX).to(torch.float8_e4m3fn).view(torch.uint8)
    # The scales as their bytes: a request's place in the staging buffer need not be 4-byte aligned.
    dst[: 4 * b * n].view(b, 4 * n).copy_(scale.t().contiguous().view(torch.uint8))
    dst[4 * b * n :].view(w, n).copy_(q.view(n, w).t())


def _split_planes(dst, x, rows: slice) -> None:
    """dst[2, w, n] (uint8) = the bf16 bits of x[rows] ([n, w]) as byte planes: plane 0 low bytes, channel-major."""
    import torch

    x = _bf16_rows(x, rows)
    n, w = x.shape
    if x.is_cuda:  # one strided copy kernel: cheap on the device
        dst.copy_(x.contiguous().view(torch.uint8).view(n, w, 2).permute(2, 1, 0))
        return
    # On the CPU a 2-byte transpose then a de-interleave is faster than the byte-wise permute.
    cols = x.contiguous().view(torch.int16).numpy().T.copy().view("u1").reshape(w, n, 2)
    out = dst.numpy()
    out[0] = cols[..., 0]
    out[1] = cols[..., 1]


class DumpPublisher:
    """Queues device work and one async copy per forward; a writer thread publishes the dumps."""

    def __init__(self, dump_dir: str, prefix: str, faults=None, layout: str = "planes"):
        if layout not in ("planes", "fp8"):
            raise ValueError(f"hidden-harvest: unknown dump layout {layout!r}")
        self.dump_dir = dump_dir
        self.prefix = prefix
        self.layout = layout
        self._faults = faults  # tests only (hidden_harvest_faults.py)
        self._hosts: list = [None] * _HOST_SLOTS
        self._free: queue.Queue[int] = queue.Queue()
        for i in range(_HOST_SLOTS):
            self._free.put(i)
        self._jobs: queue.Queue[_Job | None] = queue.Queue()
        self._copy_stream = None  # created on the first CUDA batch
        self._partials: dict[str, _Partial] = {}  # rid -> chunks so far (writer thread only)
        self._writer = threading.Thread(target=self._write_loop, name="hidden-harvest-dump-writer", daemon=True)
        self._writer.start()

    def _host(self, slot: int, nbytes: int, pinned: bool):
        import torch

        buf = self._hosts[slot]
        if buf is None or buf.numel() < nbytes:
            # Grown in powers of two so pinning (slow, once) is rare; reused for every later forward.
            size = 1 << max(nbytes - 1, 1 << 20).bit_length()
            logger.info(
                "hidden-harvest: %s host buffer %d of %.1f MiB", "pinned" if pinned else "plain", slot, size / 2**20
            )
            buf = self._hosts[slot] = torch.empty(size, dtype=torch.uint8, pin_memory=pinned)
        return buf

    def capture(
        self,
        input_ids,
        hidden_states,
        aux_hidden_states,
        rids,
        seq_lens,
        prefix_lens,
        final_layer: str = "post_norm",
        error: str | None = None,
    ) -> None:
        """Forward path: queue the device work and the copy; never waits for the host. `hidden_states`: the
        final layer as `final_layer` says. `error`: the batch cannot be captured; each request's dump says why."""
        rids = list(rids or [])
        if not any(r.startswith(self.prefix) for r in rids):
            return
        prefix_lens = list(prefix_lens or [0] * len(rids))
        blocks = _blocks(aux_hidden_states)
        aux_width = sum(int(b.shape[-1]) for b in blocks)
        hidden = int(hidden_states.shape[-1])
        # Rows are cut by the summed sequence lengths, never by tensor length: GPU graphs may pad rows.
        rows = int(sum(seq_lens))
        requests, start, offset = [], 0, 8 * rows  # int32 input ids, then an int32 non-finite count, per row
        for rid, n, p in zip(rids, seq_lens, prefix_lens):
            if rid.startswith(self.prefix):
                requests.append(_Request(rid, start, int(n), int(p), offset))
                offset += body_bytes(self.layout, aux_width, hidden, int(n)) + body_bytes(
                    self.layout, hidden, hidden, int(n)
                )
            start += int(n)
        if error is not None:
            import numpy as np

            job = _Job(-1, None, 0, 0, [], aux_width, hidden, str(blocks[0].dtype), final_layer, self.layout)
            for r in requests:
                self._publish(r.rid, r.prefix_len, np.zeros(0, dtype=np.int32), 0, job, [], error=error)
            return
        job = _Job(
            self._free.get(),
            None,
            rows,
            offset,
            requests,
            aux_width,
            hidden,
            str(blocks[0].dtype),
            final_layer,
            self.layout,
        )
        try:
            self._queue_copy(job, input_ids, hidden_states, blocks)
        except Exception:  # never break the forward: the client finds no dump and retries the request
            logger.exception("hidden-harvest: capturing a batch failed")
            self._free.put(job.slot)
            return
        self._jobs.put(job)

    def _queue_copy(self, job: _Job, input_ids, hidden_states, blocks) -> None:
        import torch

        cuda = hidden_states.is_cuda
        rows, w_aux, h = job.rows, job.aux_width, job.hidden_size
        host = self._host(job.slot, job.nbytes, pinned=cuda)
        stage = torch.empty(job.nbytes, dtype=torch.uint8, device=hidden_states.device) if cuda else host[: job.nbytes]
        stage[: 4 * rows].view(torch.int32).copy_(input_ids[:rows])
        bad = (~torch.isfinite(hidden_states[:rows])).sum(-1, dtype=torch.int32)
        for b in blocks:
            bad += (~torch.isfinite(b[:rows])).sum(-1, dtype=torch.int32)
        stage[4 * rows : 8 * rows].view(torch.int32).copy_(bad)
        for r in job.requests:
            span = slice(r.row, r.row + r.n)
            end = r.offset + body_bytes(job.layout, w_aux, h, r.n)
            if job.layout == "fp8":
                aux = blocks[0] if len(blocks) == 1 else torch.cat([b[span] for b in blocks], dim=-1)
                _quantize_fp8(stage[r.offset : end], aux, span if len(blocks) == 1 else slice(0, r.n), h)
                _quantize_fp8(stage[end : end + body_bytes(job.layout, h, h, r.n)], hidden_states, span, h)
                continue
            aux = stage[r.offset : end].view(2, w_aux, r.n)
            col = 0
            for b in blocks:
                w = int(b.shape[-1])
                _split_planes(aux[:, col : col + w], b, span)
                col += w
            _split_planes(stage[end : end + 2 * h * r.n].view(2, h, r.n), hidden_states, span)
        if cuda:
            # The copy runs on a stream of its own, after the work above, on the copy engine: the next
            # forward does not queue behind it. record_stream keeps the allocator from handing the staging
            # memory to anyone else until the copy stream is done with it.
            if self._copy_stream is None:
                self._copy_stream = torch.cuda.Stream(device=stage.device)
            self._copy_stream.wait_stream(torch.cuda.current_stream(stage.device))
            with torch.cuda.stream(self._copy_stream):
                host[: job.nbytes].copy_(stage, non_blocking=True)
                stage.record_stream(self._copy_stream)
                job.event = torch.cuda.Event()
                job.event.record(self._copy_stream)

    def _write_loop(self) -> None:
        import numpy as np

        while True:
            job = self._jobs.get()
            try:
                if job.event is not None:
                    job.event.synchronize()
                host = self._hosts[job.slot].numpy()
                ids = host[: 4 * job.rows].view(np.int32)
                bad = host[4 * job.rows : 8 * job.rows].view(np.int32)
                if self._faults is not None:
                    self._swap_rids(job.requests)
                for r in job.requests:
                    size = body_bytes(job.layout, job.aux_width, job.hidden_size, r.n) + body_bytes(
                        job.layout, job.hidden_size, job.hidden_size, r.n
                    )
                    body = memoryview(host)[r.offset : r.offset + size]
                    self._deliver(r, job, ids[r.row : r.row + r.n], int(bad[r.row : r.row + r.n].sum()), body)
            except Exception:  # a dump not published is caught by the client (missing dump -> retry)
                logger.exception("hidden-harvest: publishing dumps failed")
            finally:
                self._free.put(job.slot)
                self._jobs.task_done()

    def flush(self) -> None:
        """Wait until every queued dump is published (tests and benchmarks; the server never waits)."""
        self._jobs.join()

    def _swap_rids(self, requests: list[_Request]) -> None:
        """Fault `wrong_rid`: two whole requests of one forward trade dumps."""
        whole = [r for r in requests if r.prefix_len == 0 and r.n == total_tokens(r.rid)]
        for a, b in zip(whole[::2], whole[1::2]):
            if self._faults.roll("wrong_rid"):
                a.rid, b.rid = b.rid, a.rid
                self._faults.record("wrong_rid", a.rid)
                self._faults.record("wrong_rid", b.rid)

    def _deliver(self, r: _Request, job: _Job, ids, nonfinite: int, body) -> None:
        """Publish a request's dump, or add a prefill chunk to the request's assembly until its last chunk."""
        total = total_tokens(r.rid)
        if total is None or (r.rid not in self._partials and r.prefix_len == 0 and r.n == total):
            self._publish(r.rid, r.prefix_len, ids, nonfinite, job, [body])
            return
        part = self._partials.get(r.rid)
        if part is None:
            part = self._partials[r.rid] = _Partial(total, r.prefix_len, job.aux_width, job.hidden_size, job.layout)
        if r.prefix_len != part.first_prefix + part.got or part.got + r.n > total:
            del self._partials[r.rid]
            self._publish(
                r.rid,
                part.first_prefix,
                ids,
                nonfinite,
                job,
                [],
                error=(
                    f"prefill chunk out of order: rows {r.prefix_len}..{r.prefix_len + r.n} after {part.first_prefix + part.got} of {total}"
                ),
            )
            return
        part.add(r.n, ids, nonfinite, body)
        if part.got == total:
            del self._partials[r.rid]
            self._publish(r.rid, part.first_prefix, part.ids, part.nonfinite, job, [part.planes])

    def _publish(
        self, rid: str, prefix_len: int, ids, nonfinite: int, job: _Job, body: list, error: str | None = None
    ) -> None:
        n = len(ids) if not error else 0
        header = {
            "rid": rid,
            "num_tokens": n,
            "prefix_len": prefix_len,
            "ids_sha256": hashlib.sha256(ids.tobytes()).hexdigest(),
            "nonfinite": nonfinite,
            "layout": job.layout,
            "aux_shape": [n, job.aux_width],
            "last_shape": [n, job.hidden_size],
            "source_dtype": job.source_dtype,
            "final_layer": job.final_layer,
        }
        if error:
            header["error"] = error
        if self._faults is not None and not self._faults.apply(
            header, body, job.aux_width, job.hidden_size, self._write_dump
        ):
            return
        self._write_dump(header, body)

    def _write_dump(self, header: dict, body: list) -> None:
        head = json.dumps(header).encode()
        rid = header["rid"]
        tmp = os.path.join(self.dump_dir, f".{rid}.tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            _write_all(fd, [struct.pack("<Q", len(head)), head, *body])
        finally:
            os.close(fd)
        os.replace(tmp, os.path.join(self.dump_dir, f"{rid}.hhd"))


def total_tokens(rid: str) -> int | None:
    """The prompt length the client put in the rid (`<prefix><tag>-<n>.t<tokens>`): tells the last chunk."""
    head, sep, tail = rid.rpartition(".t")
    return int(tail) if sep and tail.isdigit() else None


class _Partial:
    """One request's prefill chunks, assembled in the writer thread into its full bodies (all T tokens)."""

    def __init__(self, total: int, first_prefix: int, aux_width: int, hidden: int, layout: str = "planes"):
        import numpy as np

        self.total, self.first_prefix, self.got, self.nonfinite = total, first_prefix, 0, 0
        self.aux_width, self.hidden = aux_width, hidden
        self.ids = np.empty(total, np.int32)
        self.parts = segments(layout, aux_width, hidden) + segments(layout, hidden, hidden)
        self.planes = np.empty(sum(rows * item for rows, item in self.parts) * total, np.uint8)

    def add(self, n: int, ids, nonfinite: int, body) -> None:
        import numpy as np

        t, p = self.total, self.got
        chunk = np.frombuffer(body, np.uint8)
        # Channel-major parts: a chunk's tokens are columns p..p+n of every row of each part.
        at_full = at_chunk = 0
        for rows, item in self.parts:
            full = self.planes[at_full : at_full + rows * t * item].reshape(rows, t * item)
            full[:, p * item : (p + n) * item] = chunk[at_chunk : at_chunk + rows * n * item].reshape(rows, n * item)
            at_full += rows * t * item
            at_chunk += rows * n * item
        self.ids[p : p + n] = ids
        self.nonfinite += nonfinite
        self.got += n


def _write_all(fd: int, parts: list) -> None:
    views = [memoryview(p).cast("B") for p in parts]
    while views:
        written = os.writev(fd, views)
        while views and written >= views[0].nbytes:
            written -= views[0].nbytes
            views.pop(0)
        if views and written:
            views[0] = views[0][written:]

"""The training loader (pipeline/tools/loader.py) on real shards: every sample exactly once per epoch across
ranks and DataLoader workers, orders that follow the seed and the epoch, the values `open_shards` gives,
packing, and the same decode over a Parquet batch in Ray Data's numpy format."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch

from pipeline.format.shards import open_shards
from pipeline.tools import loader
from pipeline.tools.loader import BatchDecoder, HiddenStatesDataset, pack
from tests_support import make_output


@pytest.fixture(scope="module")
def output(tmp_path_factory):
    path = tmp_path_factory.mktemp("loader") / "out"
    samples, norm = make_output(path, shards=7, seed=4)
    return str(path), samples


def _ids(ds) -> list[str]:
    return [s["sample_id"] for s in ds]


def _as_worker(monkeypatch, wid, nw):
    monkeypatch.setattr(loader, "get_worker_info", lambda: SimpleNamespace(id=wid, num_workers=nw))


@pytest.mark.parametrize("world, workers", [(1, 1), (2, 2), (3, 1), (4, 4)])  # 16 readers: more than shards
def test_every_sample_once_per_epoch_across_ranks_and_workers(output, monkeypatch, world, workers):
    path, samples = output
    for epoch in (0, 1):
        seen = []
        for rank in range(world):
            for wid in range(workers):
                _as_worker(monkeypatch, wid, workers)
                ds = HiddenStatesDataset(path, rank=rank, world_size=world, buffer_size=4)
                ds.set_epoch(epoch)
                seen += _ids(ds)
        assert sorted(seen) == sorted(samples), (world, workers, epoch)


def test_orders_follow_the_seed_and_the_epoch(output):
    path, samples = output
    ds = HiddenStatesDataset(path, seed=1, buffer_size=8)
    first = _ids(ds)
    assert _ids(ds) == first  # the same seed and epoch: the same order
    ds.set_epoch(1)
    assert _ids(ds) != first and sorted(_ids(ds)) == sorted(first)
    assert _ids(HiddenStatesDataset(path, seed=2, buffer_size=8)) != first
    plain = _ids(HiddenStatesDataset(path, shuffle=False))
    assert plain == [s["sample_id"] for s in open_shards(path, as_torch=False)]  # unshuffled: the output's order


def test_values_are_open_shards_values_post_or_pre_norm(output):
    path, samples = output
    for final in ("post_norm", "pre_norm"):
        want = {s["sample_id"]: s for s in open_shards(path, final=final)}
        got = list(HiddenStatesDataset(path, final=final))
        assert len(got) == len(want)
        for s in got:
            w = want[s["sample_id"]]
            assert s["final_layer"] == final
            for k in ("input_ids", "loss_mask", "aux_hidden_states", "last_hidden_state"):
                assert torch.equal(s[k], w[k]), (final, k)
            assert s["aux_hidden_states"].dtype == torch.bfloat16 and s["input_ids"].dtype == torch.int64


def test_a_real_dataloader_with_two_workers_sees_every_sample_once(output):
    path, samples = output
    ds = HiddenStatesDataset(path, buffer_size=4)
    dl = torch.utils.data.DataLoader(ds, batch_size=None, num_workers=2)
    assert sorted(s["sample_id"] for s in dl) == sorted(samples)


def test_packing_fills_rows_up_to_the_limit_and_never_cuts_a_sample(output):
    path, samples = output
    plain = list(HiddenStatesDataset(path, shuffle=False))
    rows = list(pack(iter(plain), 12))
    assert [sid for r in rows for sid in r["sample_ids"]] == [s["sample_id"] for s in plain]
    for r in rows:
        n = int(r["lengths"].sum())
        assert r["input_ids"].shape == r["loss_mask"].shape == (n,) and r["last_hidden_state"].shape[0] == n
        assert n <= 12 or len(r["sample_ids"]) == 1
    for a, b in zip(rows, rows[1:]):  # a row closes only when the next sample would not fit
        assert int(a["lengths"].sum()) + int(b["lengths"][0]) > 12
    start = 0
    first = rows[0]
    for sid, n in zip(first["sample_ids"], first["lengths"].tolist()):
        s = next(p for p in plain if p["sample_id"] == sid)
        assert torch.equal(first["aux_hidden_states"][start : start + n], s["aux_hidden_states"])
        start += n
    packed = list(HiddenStatesDataset(path, pack_to=12, shuffle=False))
    assert [r["sample_ids"] for r in packed] == [r["sample_ids"] for r in rows]


def test_the_batch_decoder_reads_ray_datas_numpy_batches(output):
    """Ray Data's numpy batch format: list columns as object arrays of arrays, binary ones as bytes."""
    path, samples = output
    table = pq.read_table(f"{path}/shards")
    batch = {c: table[c].to_numpy(zero_copy_only=False) for c in table.column_names}
    decoded = BatchDecoder(path)(batch)
    want = {s["sample_id"]: s for s in open_shards(path)}
    assert len(decoded) == len(want) == len(samples)
    for s in decoded:
        w = want[s["sample_id"]]
        for k in ("input_ids", "loss_mask", "aux_hidden_states", "last_hidden_state"):
            assert torch.equal(s[k], w[k]), k
    pre = BatchDecoder(path, final="pre_norm", as_torch=False)(batch)
    for s in pre:
        ids, mask, aux, last = samples[s["sample_id"]]
        np.testing.assert_array_equal(s["last_hidden_state"], last)

import os
from types import SimpleNamespace

import numpy as np
import pytest

from actors.dump import DumpError, dump_path, read_dump
from actors.validate import check_capture


def bits(rng, rows, cols) -> np.ndarray:
    return rng.integers(0, 0x7F00, size=(rows, cols), dtype=np.uint16)


def test_read_dump_round_trip(make_dump, tmp_path):
    rng = np.random.default_rng(0)
    aux, last = bits(rng, 5, 12), bits(rng, 5, 4)
    path = make_dump("hh-1", [1, 2, 3, 4, 5], aux, last)
    assert path == dump_path(tmp_path, "hh-1")
    assert os.listdir(tmp_path) == ["hh-1.hhd"]  # the hook's temporary was renamed away
    cap = read_dump(path)
    assert cap.header["rid"] == "hh-1" and cap.header["num_tokens"] == 5
    assert cap.aux.dtype == np.uint16 and cap.last.dtype == np.uint16
    np.testing.assert_array_equal(cap.aux, aux)
    np.testing.assert_array_equal(cap.last, last)


@pytest.fixture
def dump_bytes(make_dump):
    rng = np.random.default_rng(1)
    return make_dump("hh-t", [7, 8, 9], bits(rng, 3, 6), bits(rng, 3, 2)).read_bytes()


def write(tmp_path, data: bytes):
    path = tmp_path / "cut.hhd"
    path.write_bytes(data)
    return path


@pytest.mark.parametrize("cut", [2, 4, 3 * 2 * 2])
def test_truncated_body_is_dump_error(tmp_path, dump_bytes, cut):
    with pytest.raises(DumpError, match="holds .* values, header says 24"):
        read_dump(write(tmp_path, dump_bytes[:-cut]))


def test_extra_body_is_dump_error(tmp_path, dump_bytes):
    with pytest.raises(DumpError):
        read_dump(write(tmp_path, dump_bytes + b"\0\0"))


def test_shorter_than_length_prefix_is_dump_error(tmp_path, dump_bytes):
    with pytest.raises(DumpError, match="truncated"):
        read_dump(write(tmp_path, dump_bytes[:5]))


def test_truncated_by_one_byte_is_dump_error(tmp_path, dump_bytes):
    with pytest.raises(DumpError):
        read_dump(write(tmp_path, dump_bytes[:-1]))


def test_truncated_header_is_dump_error(tmp_path, dump_bytes):
    with pytest.raises(DumpError):
        read_dump(write(tmp_path, dump_bytes[:20]))


def test_hook_dump_batch_slices_packed_rows_per_request(dump_hook, tmp_path):
    """dump_batch on a packed extend batch: one file per hh- request, rows sliced by extend_seq_lens_cpu."""
    import torch

    torch.manual_seed(0)
    seq_lens = [3, 2, 4]
    total = sum(seq_lens)
    input_ids = torch.arange(100, 100 + total + 2)  # 2 padding rows, as CUDA graphs may add
    hidden = torch.randn(total + 2, 4, dtype=torch.bfloat16)
    aux = [torch.randn(total + 2, 4, dtype=torch.bfloat16) for _ in range(3)]
    batch = SimpleNamespace(
        rids=["hh-a", "other-b", "hh-c"], extend_seq_lens_cpu=seq_lens, extend_prefix_lens_cpu=[0, 0, 0]
    )
    dump_hook.dump_batch(input_ids, hidden, aux, batch, str(tmp_path), "hh-")
    assert sorted(os.listdir(tmp_path)) == ["hh-a.hhd", "hh-c.hhd"]

    as_bits = lambda t: t.view(torch.int16).numpy().view(np.uint16)  # noqa: E731
    packed = torch.cat(aux, dim=-1)
    for rid, start, n in (("hh-a", 0, 3), ("hh-c", 5, 4)):
        cap = read_dump(dump_path(tmp_path, rid))
        ids = input_ids[start : start + n].tolist()
        assert cap.header["num_tokens"] == n and cap.header["prefix_len"] == 0
        np.testing.assert_array_equal(cap.aux, as_bits(packed[start : start + n]))
        np.testing.assert_array_equal(cap.last, as_bits(hidden[start : start + n]))
        assert check_capture(cap, ids, aux_width=12, hidden_size=4) is None


def test_hook_dump_batch_ignores_batches_without_prefixed_rids(dump_hook, tmp_path):
    import torch

    batch = SimpleNamespace(rids=["warmup"], extend_seq_lens_cpu=[2], extend_prefix_lens_cpu=None)
    t = torch.zeros(2, 4, dtype=torch.bfloat16)
    dump_hook.dump_batch(torch.arange(2), t, [t], batch, str(tmp_path), "hh-")
    assert os.listdir(tmp_path) == []

"""actors/hf/staging.py: the Triton kernel CUDA engines stage with (run here by Triton's interpreter) writes
exactly the bytes and non-finite counts of the torch ops, and an unusable kernel falls back to them."""

from __future__ import annotations

import logging
import multiprocessing
import os
from concurrent.futures import ProcessPoolExecutor

import numpy as np
import pytest
import torch

from actors.hf import staging
from actors.hf.staging import TritonStager, packed_starts, padded_starts, plane_offsets, stage_torch


def _interpret() -> None:
    os.environ["TRITON_INTERPRET"] = "1"


@pytest.fixture(scope="module")
def interpreter():
    """A child process in which Triton's interpreter runs the kernel on CPU tensors. The switch is read
    when triton is imported, so it is set before, in a process of its own: this one's triton stays as is."""
    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn"), initializer=_interpret) as pool:
        yield pool


def _triton_stage(lengths, t, h, k, seed, packed=False):
    body, bad = _stage(TritonStager(), _layers(lengths, t, h, k, seed), lengths, packed)
    return body.numpy(), bad


def _triton_checked() -> bool:
    return isinstance(TritonStager.checked("cpu"), TritonStager)


def _layers(lengths, t, h, k, seed):
    gen = torch.Generator().manual_seed(seed)
    layers = [(torch.randn(len(lengths), t, h, generator=gen) * 8).to(torch.bfloat16) for _ in range(k + 1)]
    # Non-finite values at random places, padded positions included (those must not count).
    for x in layers:
        flat = x.view(-1)
        at = torch.randint(0, flat.numel(), (6,), generator=gen)
        flat[at[:2]], flat[at[2:4]], flat[at[4:]] = float("nan"), float("inf"), float("-inf")
    return layers


def _packed(layers, lengths):
    """The padded rows' real tokens end to end in one row, as a packed forward lays them out, and where each starts."""
    packed = [torch.cat([x[row, :n] for row, n in enumerate(lengths)])[None] for x in layers]
    return packed, packed_starts(lengths)


def _stage(fill, layers, lengths, packed=False, layout="planes"):
    offsets = plane_offsets(lengths, len(layers), layers[-1].shape[-1], layout)
    body = torch.full((int(offsets[-1]),), 0xAB, dtype=torch.uint8)  # a byte left unwritten shows
    layers, starts = _packed(layers, lengths) if packed else (layers, padded_starts(*layers[-1].shape[:2]))
    bad = torch.zeros(layers[-1].shape[:2], dtype=torch.int32)
    fill(layers, lengths, starts, offsets, body, bad)
    return body, [int(bad.view(-1)[a : a + n].sum()) for a, n in zip(starts, lengths)]


@pytest.mark.parametrize("packed", [False, True], ids=["padded", "packed"])
@pytest.mark.parametrize(
    "lengths, t, h, k",
    [([5, 64, 65, 1], 70, 40, 3), ([130], 130, 128, 1), ([3, 2], 9, 64, 0), ([200, 17, 128], 200, 72, 2)],
)
def test_the_triton_kernel_writes_the_torch_ops_bytes_and_counts(interpreter, lengths, t, h, k, packed):
    layers = _layers(lengths, t, h, k, seed=len(lengths) * h)
    want, want_bad = _stage(stage_torch, layers, lengths, packed)
    got, got_bad = interpreter.submit(_triton_stage, lengths, t, h, k, len(lengths) * h, packed).result()
    assert got_bad == want_bad
    assert sum(want_bad) > 0  # the batch did carry non-finite values in real positions
    assert np.array_equal(got, want.numpy())
    expected_nonfinite = sum(int((~torch.isfinite(x[row, :n])).sum()) for x in layers for row, n in enumerate(lengths))
    assert sum(got_bad) == expected_nonfinite


@pytest.mark.parametrize("layout", ["planes", "fp8"])
def test_a_packed_row_stages_the_same_bodies_and_counts_as_padded_rows(layout):
    """A packed forward's states (the requests end to end in one row) give every request the body and
    non-finite count its padded row gives; padding in the padded rows is neither copied nor counted."""
    lengths, t, h, k = [5, 64, 1, 30], 66, 40, 2
    fill = stage_torch if layout == "planes" else staging.stage_fp8
    layers = _layers(lengths, t, h, k, seed=3)
    want, want_bad = _stage(fill, layers, lengths, layout=layout)
    got, got_bad = _stage(fill, layers, lengths, packed=True, layout=layout)
    assert got_bad == want_bad and sum(want_bad) > 0
    assert torch.equal(got, want)


def test_a_kernel_that_disagrees_leaves_the_torch_ops_in_place(monkeypatch, caplog):
    def off_by_one_byte(self, layers, lengths, starts, offsets, body, bad):
        stage_torch(layers, lengths, starts, offsets, body, bad)
        body[len(body) // 2] ^= 1

    monkeypatch.setattr(staging, "_build_kernel", lambda: None)
    monkeypatch.setattr(TritonStager, "__call__", off_by_one_byte)
    with caplog.at_level(logging.WARNING, logger="actors.hf.staging"):
        assert TritonStager.checked("cpu") is None
    assert "bytes equal: False" in caplog.text


def test_without_triton_the_torch_ops_stage(monkeypatch, caplog):
    def missing():
        raise ModuleNotFoundError("No module named 'triton'")

    monkeypatch.setattr(staging, "_build_kernel", missing)
    with caplog.at_level(logging.WARNING, logger="actors.hf.staging"):
        assert TritonStager.checked("cpu") is None
    assert "No module named 'triton'" in caplog.text


def test_the_check_passes_a_kernel_that_agrees(interpreter):
    assert interpreter.submit(_triton_checked).result()


@pytest.mark.parametrize("lengths, t, h, k", [([5, 64, 1], 70, 40, 3), ([3, 2], 9, 64, 0), ([17], 17, 10, 2)])
def test_fp8_staging_writes_each_requests_codec_body_and_counts(lengths, t, h, k):
    """Each request's fp8 body equals the codec's quantization of its real tokens (aux layers packed, then
    the final layer); padded positions are neither copied nor counted."""
    from pipeline.format.codec import quantize

    layers = _layers(lengths, t, h, k, seed=11)
    offsets = plane_offsets(lengths, k + 1, h, "fp8")
    body = torch.full((int(offsets[-1]),), 0xAB, dtype=torch.uint8)
    bad = torch.zeros(layers[-1].shape[:2], dtype=torch.int32)
    staging.stage_fp8(layers, lengths, padded_starts(len(lengths), t), offsets, body, bad)
    _, want_bad = _stage(stage_torch, layers, lengths)
    assert [int(bad[r, :n].sum()) for r, n in enumerate(lengths)] == want_bad
    as_bits = lambda x: x.view(torch.int16).numpy().view(np.uint16)  # noqa: E731
    for row, n in enumerate(lengths):
        got = body[int(offsets[row]) : int(offsets[row + 1])].numpy()
        aux_bits = as_bits(torch.cat([x[row, :n] for x in layers[:-1]], dim=-1)) if k else np.zeros((n, 0), np.uint16)
        want = np.concatenate([quantize(aux_bits, h), quantize(as_bits(layers[-1][row, :n]), h)])
        # Non-finite inputs quantize to NaN codes (0x7F, either sign; the capture is rejected on its count
        # anyway): NaN's sign is left out of the comparison, in the value bytes only.
        values = np.zeros(got.size, bool)
        values[4 * k * n : (4 + h) * k * n] = values[(4 + h) * k * n + 4 * n :] = True
        nan = lambda b, v=values: np.where(v & ((b & 0x7F) == 0x7F), 0x7F, b)  # noqa: E731
        np.testing.assert_array_equal(nan(got), nan(want))

"""bf16 products as float32 products rounded to bf16 (actors/hf/bf16_gemms.py): the same arithmetic as torch's
bf16 matmul up to the order of float32 sums, a bf16 forward as far from float32 as torch's own, and the decoder
switches it on exactly where the CPU has no native bf16 matmul."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from actors.hf import bf16_gemms
from actors.hf.decoder import Decoder

AUX = (1, 14, 26)


def _products(a, b, c3, d3):
    return {
        "linear": F.linear(a, b),
        "matmul": a @ b.T,
        "mm": torch.mm(a, b.T),
        "bmm": torch.bmm(c3, d3),
        "baddbmm": torch.baddbmm(torch.ones(4, 48, 40, dtype=torch.bfloat16), c3, d3),
        "addmm": torch.addmm(torch.ones(48, 96, dtype=torch.bfloat16), a, b.T),
    }


def test_products_are_torchs_bf16_products_up_to_the_order_of_sums():
    g = torch.Generator().manual_seed(0)
    a, b = (torch.randn(s, generator=g).bfloat16() for s in ((48, 320), (96, 320)))
    c3, d3 = (torch.randn(s, generator=g).bfloat16() for s in ((4, 48, 64), (4, 64, 40)))
    native = _products(a, b, c3, d3)
    with bf16_gemms.float32_gemms():
        widened = _products(a, b, c3, d3)
        other = torch.add(a, a)  # not a product: untouched
    assert other.dtype == torch.bfloat16
    for name, x in native.items():
        y = widened[name]
        assert y.dtype == torch.bfloat16 and y.shape == x.shape, name
        differ = (x != y).float().mean().item()
        # One bf16 step (2**-7 relative) at most, and rarely: the sums run in float32 either way.
        step = (x.float() - y.float()).abs() / x.float().abs().clamp_min(1e-2)
        assert differ < 0.01 and step.max().item() <= 2**-7 + 1e-6, (name, differ, step.max().item())
    with bf16_gemms.float32_gemms(on=False):
        assert torch.equal(F.linear(a, b), native["linear"])
    # A mixed product keeps torch's own answer: here its error, not a silent bf16 result.
    with bf16_gemms.float32_gemms(), pytest.raises(RuntimeError):
        F.linear(a, b.float())


def test_a_forward_is_as_far_from_float32_as_torchs_own_bf16_forward(model_dir, monkeypatch):
    """What a bf16 forward is used for (the audit's yardstick): its distance from the float32 truth."""
    ids = [list(range(200 + 7 * i, 200 + 7 * i + n)) for i, n in enumerate((40, 90))]

    def states(dtype, gemms):
        monkeypatch.setattr(bf16_gemms, "needed", lambda device, dt: gemms)
        dec = Decoder(str(model_dir), AUX, "cpu", dtype).load()
        out = []
        for seq in ids:
            dec.forward([seq], keep=True)
            aux, last = dec.outputs()
            out.append([x[0].float().numpy() for x in (*aux, last)])
        dec.close()
        return out

    truth, own, widened = states("float32", False), states("bfloat16", False), states("bfloat16", True)

    def distance(got):
        return np.array(
            [[np.linalg.norm(g - t) / np.linalg.norm(t) for g, t in zip(gs, ts)] for gs, ts in zip(got, truth)]
        )

    d_own, d_widened = distance(own), distance(widened)
    assert (d_own > 0).all() and (d_widened > 0).all()  # both are bf16 forwards, neither the truth
    ratio = d_widened.mean() / d_own.mean()
    assert 0.8 < ratio < 1.25, (d_own, d_widened)


@pytest.mark.parametrize(
    ("device", "dtype", "native", "on"),
    [
        ("cpu", "bfloat16", False, True),
        ("cpu", "bfloat16", True, False),
        ("cpu", "bfloat16", None, False),  # cannot tell: torch's own path
        ("cpu", "float32", False, False),
        ("cuda", "bfloat16", False, False),
    ],
)
def test_on_only_for_bf16_on_a_cpu_without_native_bf16_matmul(monkeypatch, device, dtype, native, on):
    monkeypatch.setattr("actors.cpu.cpu_has_bf16_matmul", lambda cpuinfo=None: native)
    assert bf16_gemms.needed(device, dtype) is on
    assert Decoder("unused", AUX, device, dtype).float32_gemms is on


def test_the_decoders_forward_runs_inside_the_mode(model_dir, monkeypatch):
    monkeypatch.setattr("actors.cpu.cpu_has_bf16_matmul", lambda cpuinfo=None: False)
    entered = []
    real = bf16_gemms.float32_gemms

    def spy(on=True):
        entered.append(on)
        return real(on)

    monkeypatch.setattr(bf16_gemms, "float32_gemms", spy)
    dec = Decoder(str(model_dir), AUX, "cpu", "bfloat16").load()
    dec.forward([[200, 201, 202]], keep=False)
    dec.close()
    assert entered == [True]


@pytest.mark.parametrize("native, products", [(False, "float32"), (True, "bfloat16")])
def test_the_hf_engine_reports_how_its_actors_cpu_ran_the_products(monkeypatch, native, products):
    """The manifest's per-actor counters say it, since an actor's CPU in a cluster need not be the driver's."""
    from actors.hf.engine import HFEngine

    monkeypatch.setattr("actors.cpu.cpu_has_bf16_matmul", lambda cpuinfo=None: native)
    assert HFEngine("unused", AUX, device="cpu").stats()["products"] == products
    assert "products" not in HFEngine("unused", AUX, device="cuda").stats()

"""Packed forwards (actors/hf/packing.py, actors/hf/batching.take_packed): which requests a packed forward
takes, the start-up check that refuses a packed forward computing something else, and which families pack."""

from __future__ import annotations

import logging
from concurrent.futures import Future

import numpy as np
import pytest

from actors.hf import pack_check, packing
from actors.hf.batching import take_packed
from actors.hf.engine import HFEngine
from actors.hf.outputs import Request

AUX = (1, 14, 26)


def _req(key, n, order):
    return Request(key, [1] * n, Future(), 0.0, order)


def _keys(batch):
    return [r.key for r in batch]


# ---- what a packed forward takes -----------------------------------------------------------------------


def test_a_packed_forward_takes_the_oldest_batch_longest_first_then_fills_from_the_next():
    pool = [_req(k, n, o) for k, n, o in (("a60", 60, 1), ("a30", 30, 1), ("b90", 90, 2), ("b5", 5, 2), ("b8", 8, 2))]
    # 60 + 30 of the oldest batch; b90 does not fit in what is left (10), b8 does, then nothing more.
    assert _keys(take_packed(pool, 100)) == ["a60", "a30", "b8"]
    assert _keys(pool) == ["b90", "b5"]
    assert _keys(take_packed(pool, 100)) == ["b90", "b5"]
    assert pool == []


def test_a_request_longer_than_the_budget_runs_alone_and_nothing_is_padded():
    pool = [_req("short", 10, 0), _req("long", 500, 0), _req("mid", 80, 1)]
    assert _keys(take_packed(pool, 100)) == ["long"]
    assert _keys(take_packed(pool, 100)) == ["short", "mid"]  # the older batch first, then what fits
    rng = np.random.default_rng(0)
    pool = [
        _req(f"r{i}", int(n), int(o))
        for i, (n, o) in enumerate(zip(rng.integers(1, 300, 200), rng.integers(0, 5, 200)))
    ]
    total, seen = sum(len(r.ids) for r in pool), 0
    while pool:
        batch = take_packed(pool, 1024)
        tokens = sum(len(r.ids) for r in batch)
        assert tokens <= 1024 or len(batch) == 1
        seen += tokens
    assert seen == total  # every request once


def test_caller_batches_complete_in_order_under_packing():
    rng = np.random.default_rng(1)
    pool = [_req(f"{o}-{i}", int(n), o) for o in range(4) for i, n in enumerate(rng.integers(1, 400, 30))]
    finished = []
    left = {o: 30 for o in range(4)}
    while pool:
        for r in take_packed(pool, 2048):
            o = r.order
            left[o] -= 1
            if left[o] == 0:
                finished.append(o)
    assert finished == [0, 1, 2, 3]


# ---- the start-up check -------------------------------------------------------------------------------


def test_a_packed_forward_that_lets_sequences_see_each_other_is_refused(model_dir, monkeypatch, caplog):
    honest = packing._per_sequence

    def leaking(query, key, value, spans, scaling):  # causal attention over the whole row
        return honest(query, key, value, packing.Spans(np.array([0, int(spans.starts[-1])]), 0), scaling)

    monkeypatch.setattr(packing, "_per_sequence", leaking)
    with pytest.raises(RuntimeError, match="engine.packing=on: .* differ from the padded forward's by"):
        HFEngine(str(model_dir), AUX, packing="on").start()
    with caplog.at_level(logging.WARNING, logger="actors.hf.pack_check"):
        eng = HFEngine(str(model_dir), AUX, packing="auto", device="cpu")
        eng.decoder.load()
        assert pack_check.choose(eng.decoder, eng.packing) is False
    assert "padded forwards" in caplog.text and "cannot run packed" in caplog.text
    # Back on sdpa: the engine's padded forwards run as before.
    assert eng.decoder.base.config._attn_implementation == "sdpa"


def test_an_honest_packed_forward_passes_the_check_and_packing_is_asked_for(model_dir):
    eng = HFEngine(str(model_dir), AUX, device="cpu")
    assert eng.packing == "off"
    eng.decoder.load()
    assert pack_check.choose(eng.decoder, eng.packing) is False  # off by default: padded, nothing checked
    assert pack_check.choose(eng.decoder, "auto") is True and pack_check.check(eng.decoder) is None
    with pytest.raises(ValueError, match="packing 'sometimes'"):
        HFEngine(str(model_dir), AUX, packing="sometimes")


def test_engine_packing_comes_from_the_config():
    from conf.schema import load_config

    for value in ("auto", "on", "off"):
        cfg = load_config("conf/default.yaml", ["engine.name=hf", f"engine.packing={value}"])
        assert HFEngine.kwargs_for(cfg.engine, "m", (1,), True, 2)["packing"] == value
    with pytest.raises(Exception, match="packing"):
        load_config("conf/default.yaml", ["engine.name=hf", "engine.packing=sometimes"])


def test_packing_defaults_to_the_device():
    """Unset, engine.packing is auto on CUDA (packed where the model allows) and off on a CPU; the manifest's
    engine provenance records what the engine was asked for."""
    from conf.schema import load_config

    cfg = load_config("conf/default.yaml", ["engine.name=hf"])
    assert cfg.engine.packing is None
    for cuda, want in ((True, "auto"), (False, "off")):
        kwargs = HFEngine.kwargs_for(cfg.engine, "m", (1,), cuda, 2)
        assert HFEngine.provenance(kwargs, cuda)["packing"] == want
        assert HFEngine("m", AUX, device="cuda" if cuda else "cpu", packing=kwargs["packing"]).packing == want
    set_off = HFEngine.kwargs_for(
        load_config("conf/default.yaml", ["engine.name=hf", "engine.packing=off"]).engine, "m", (1,), True, 2
    )
    assert HFEngine("m", AUX, device="cuda", packing=set_off["packing"]).packing == "off"


# ---- families ----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "family, why",
    [
        ("qwen3_moe", None),
        ("deepseek_v3", None),
        ("gemma3_text", "windowed or chunked attention"),
        ("mistral", "sliding_window"),
        ("gpt_oss", "attention 'eager'"),
    ],
)
def test_which_families_pack(family, why, model_dir, tmp_path, caplog):
    """Families whose attention is plain causal pack, and their packed captures hold each request's own
    states; windowed, soft-capped or sink attention is refused by name before any forward: `on` fails, `auto`
    (CUDA's default) runs padded and says so without a warning, since nothing is wrong."""
    import logging

    from tests.families import make_model

    path = make_model(family, tmp_path / family, model_dir)
    aux = (1, 3, 5)
    if why is not None:
        with pytest.raises(RuntimeError, match=why):
            HFEngine(str(path), aux, packing="on").start()
        with (
            caplog.at_level(logging.INFO, logger="actors.hf.pack_check"),
            HFEngine(str(path), aux, packing="auto") as eng,
        ):
            assert eng.packed is False
        said = [r for r in caplog.records if "cannot run packed" in r.getMessage()]
        assert said and why in said[0].getMessage() and all(r.levelno == logging.INFO for r in said)
        return
    rng = np.random.default_rng(2)
    reqs = [(f"r{i}", rng.integers(0, 1000, n).tolist()) for i, n in enumerate((40, 7, 90, 1))]
    got = {}
    for mode in ("off", "on"):
        with HFEngine(str(path), aux, max_batch_tokens=1024, packing=mode) as eng:
            assert eng.packed is (mode == "on")
            got[mode] = {k: r.capture for k, r in eng.capture(reqs).items()}
    for key, ids in reqs:
        a, b = got["on"][key], got["off"][key]
        assert a.header.ids_sha256 == b.header.ids_sha256 and a.header.num_tokens == len(ids)
        for x, y in zip(a.bits(), b.bits()):
            fx, fy = ((np.ascontiguousarray(v).astype(np.uint32) << 16).view(np.float32) for v in (x, y))
            assert np.linalg.norm(fx - fy) <= 0.05 * np.linalg.norm(fy), key

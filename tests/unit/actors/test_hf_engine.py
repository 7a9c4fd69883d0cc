"""The in-process transformers engine on the default SmolLM2 model, on CPU: captures, batching, padding,
non-finite values, bad ids, close(), and the float32 states() the audit uses."""

from __future__ import annotations

import json
import threading
import time
from concurrent.futures import Future
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from actors.engine import EngineDied
from actors.hf.batching import BatchPolicy, FillFloor, fill_share, take_batch
from actors.hf.device_clock import layer_excess_ms, slow_layers
from actors.hf.engine import HFEngine
from actors.hf.outputs import Request, Staged, ids_sha256
from actors.hf.reference import ReferenceStates
from actors.validate import check_capture

AUX = (1, 14, 26)  # the job's default for SmolLM2 (30 layers)


@pytest.fixture(scope="module")
def engine(model_dir):
    with HFEngine(str(model_dir), AUX, max_batch_tokens=4096, cpu_threads=2) as eng:
        yield eng


@pytest.fixture(scope="module")
def packed_engine(model_dir):
    with HFEngine(str(model_dir), AUX, max_batch_tokens=4096, cpu_threads=2, packing="on") as eng:
        assert eng.packed
        yield eng


@pytest.fixture(params=["padded", "packed"])
def any_engine(request):
    """The engine with padded rows, then with packed ones (actors/hf/packing.py): the same contract."""
    return request.getfixturevalue("engine" if request.param == "padded" else "packed_engine")


def _submit_together(eng: HFEngine, requests: list[tuple[str, list[int]]], order: float = 0.0) -> dict:
    """Every request is waiting before the worker takes any."""
    futures = eng.submit_together(requests, order=order)
    return {f.result(timeout=120).key: f.result() for f in futures}


def _cos(a, b) -> torch.Tensor:
    return torch.nn.functional.cosine_similarity(torch.as_tensor(a).float(), torch.as_tensor(b).float(), dim=-1)


def _bf16(bits: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(bits).view(np.int16)).view(torch.bfloat16).float()


# ---- captures against transformers -----------------------------------------------------------------


def test_captures_match_a_single_request_transformers_forward(model_dir):
    from bench.check_hf_engine import check

    # Mixed lengths in one engine (batched with right padding), each against its own forward.
    assert check(str(model_dir), "cpu", lengths=(5, 40, 33, 120, 7, 64, 17)) == []


def test_pre_norm_captures_are_the_last_layers_output_and_our_norm_of_them_is_the_models(
    model_dir, text_ids, references
):
    """final_layer=pre_norm: the final state is the input of the model's final norm, within bf16 noise of
    float32; the norm stored with outputs, applied to it, agrees with the norm's own output in the same forward
    (every token at cosine >= 0.9999; the bit-identical share is printed)."""
    from actors.hf.decoder import Decoder
    from pipeline.format.final_norm import read_final_norm
    from pipeline.format.shards import ShardLayout

    ids = list(text_ids[0])
    with HFEngine(str(model_dir), AUX, max_batch_tokens=4096, cpu_threads=2, final_layer="pre_norm") as eng:
        cap = eng.capture([("a", ids)])["a"].capture
    assert cap.header.final_layer == "pre_norm"
    references.check("pre-norm", AUX, ids, *cap.bits(), final_layer="pre_norm")

    dec = Decoder(str(model_dir), AUX, "cpu", "bfloat16", final_layer="pre_norm").load()
    own = []
    hook = dec.norm.register_forward_hook(lambda _m, _i, out: own.append(out))
    try:
        dec.forward([ids], keep=True)
        _, pre = dec.outputs()
    finally:
        hook.remove()
        dec.close()
    as_bits = lambda t: t[0].contiguous().view(torch.int16).numpy().view(np.uint16)  # noqa: E731
    norm = read_final_norm(model_dir)
    ours, theirs = norm.apply_bits(as_bits(pre)), as_bits(own[0])
    np.testing.assert_array_equal(as_bits(pre), cap.bits()[1])  # the engine stores exactly that input
    assert _cos(_bf16(ours), _bf16(theirs)).min().item() >= 0.9999
    print(f"\nour final norm vs the model's, same forward: {(ours == theirs).mean():.1%} of values bit-identical")
    assert ShardLayout(AUX, 576, final_norm=norm).final_layer == "pre_norm"


def test_mixed_lengths_run_batched_and_padding_is_never_stored(any_engine, model_dir, references):
    engine = any_engine
    h = json.loads((Path(model_dir) / "config.json").read_text())["hidden_size"]
    rng = np.random.default_rng(1)
    lengths = [3, 70, 12, 41, 1, 70, 29]
    reqs = [(f"r{i}", rng.integers(0, engine.vocab_size, size=n).tolist()) for i, n in enumerate(lengths)]
    before, padded_before = engine.batches, engine.padded_tokens
    res = _submit_together(engine, reqs)
    forwards = engine.batches - before
    assert forwards < len(reqs), f"{len(reqs)} requests of mixed lengths ran in {forwards} forwards"
    if engine.packed:  # one row of every request end to end: nothing padded
        assert forwards == 1 and engine.padded_tokens - padded_before == sum(lengths)
    for key, ids in reqs:
        cap = res[key].capture
        assert res[key].error is None and cap is not None
        n = len(ids)
        assert (
            cap.header.num_tokens == n and cap.header.aux_shape == (n, len(AUX) * h) and cap.header.last_shape == (n, h)
        )
        assert cap.header.ids_sha256 == ids_sha256(np.array(ids))
        aux, last = cap.bits()
        assert aux.shape == (n, len(AUX) * h) and last.shape == (n, h)
        assert check_capture(cap, ids, len(AUX) * h, h) is None
    # A short request batched with long ones holds its own states (no padding leaks in): it and the same
    # request alone are both within bf16 noise of float32.
    alone = _submit_together(engine, [("alone", reqs[2][1])])["alone"].capture
    references.check("r2 batched", AUX, reqs[2][1], *res["r2"].capture.bits())
    references.check("r2 alone", AUX, reqs[2][1], *alone.bits())
    # The last request of a packed row sees none of the six before it.
    references.check("r6 batched", AUX, reqs[6][1], *res["r6"].capture.bits())


@pytest.mark.parametrize("n_aux", [3, 0])
def test_staging_lays_out_each_request_as_the_codecs_byte_planes(n_aux):
    """The staging buffer against pipeline.format.codec.to_planes (numpy, no torch): per request its aux planes
    [2, K*H, n] (layers side by side), then its final-state planes [2, H, n]; padded positions never appear."""
    from pipeline.format.codec import to_planes

    b, t, h, lengths = 3, 9, 8, [9, 4, 1]
    gen = torch.Generator().manual_seed(0)
    aux = [torch.randn(b, t, h, generator=gen).to(torch.bfloat16) for _ in range(n_aux)]
    last = torch.randn(b, t, h, generator=gen).to(torch.bfloat16)
    eng = HFEngine("unused", tuple(range(n_aux)))  # a CPU engine: staging needs no model, only the kept outputs
    eng.decoder._taken = {("aux", k): a for k, a in enumerate(aux)} | {("last", 0): last}
    batch = [Request(str(i), [1] * n, Future(), 0.0) for i, n in enumerate(lengths)]
    staged = eng.outputs.stage(batch, np.ones((b, t), dtype=np.int64), False, eng.stager)
    body, offsets, nonfinite, widths = staged.planes, staged.offsets, staged.nonfinite, staged.widths
    assert widths == (n_aux * h, h) and nonfinite.shape == (b, t) and not nonfinite.any()
    assert offsets[-1] == len(body) == sum(2 * n * (n_aux + 1) * h for n in lengths)

    def bits(x, row, n):
        return x[row, :n].contiguous().view(torch.int16).numpy().view(np.uint16)

    for row, n in enumerate(lengths):
        aux_bits = np.concatenate([bits(a, row, n) for a in aux], axis=1) if aux else np.zeros((n, 0), np.uint16)
        want = np.concatenate([to_planes(aux_bits).ravel(), to_planes(bits(last, row, n)).ravel()])
        assert np.array_equal(body[offsets[row] : offsets[row + 1]], want)


def test_device_time_adds_forward_staging_and_the_gap_between_batches():
    class Ev:  # a CUDA event's elapsed_time (ms) on a fake clock
        def __init__(self, ms):
            self.ms = ms

        def elapsed_time(self, other):
            return other.ms - self.ms

    eng = HFEngine("unused", AUX, device="cuda")  # nothing touches a device before start()
    eng.reset_stats()
    assert eng.clock.observe({"first_layer": Ev(0), "norm": Ev(800), "end": Ev(820)}) == (800, None)
    assert eng.clock.observe({"first_layer": Ev(830), "norm": Ev(1630), "end": Ev(1650)}) == (800, 10)
    assert eng.clock.observe({"norm": Ev(2000)}) is None  # a batch without its marks (a failed forward) adds nothing
    s = eng.stats()
    assert (s["device_forward_s"], s["device_stage_s"], s["device_between_s"]) == (1.6, 0.04, 0.01)


class _Ev:  # a CUDA event on a fake clock (ms)
    def __init__(self, ms):
        self.ms = ms

    def elapsed_time(self, other):
        return other.ms - self.ms


def test_layer_excess_is_the_time_beyond_the_median_layer():
    """Every layer of a uniform stack does the same work: a layer that took longer waited on the device."""
    layers = [_Ev(0), _Ev(10), _Ev(20), _Ev(45), _Ev(55)]  # the third layer ran 25 ms, the others 10
    assert layer_excess_ms(layers, _Ev(65)) == pytest.approx(15.0)
    assert layer_excess_ms([], _Ev(65)) == 0.0
    assert slow_layers(layers, _Ev(65)) == [[2, 15.0]]
    assert slow_layers(layers, _Ev(65), over_ms=20) == []
    assert slow_layers([], _Ev(65)) == []


def test_device_time_counts_layer_excess_and_a_short_lead_and_logs_each_forward(tmp_path):
    # debug.forward_log: nothing touches a device before start(); the clock's hooks go on a stand-in decoder.
    eng = HFEngine("unused", AUX, device="cuda", forward_log=str(tmp_path))
    eng.clock.start(SimpleNamespace(layers=[], norm=torch.nn.Identity()))
    eng.reset_stats()  # the log marks where the counted forwards begin
    staged = Staged([Request("a", [1] * 7, Future(), 0.0), Request("b", [1] * 5, Future(), 0.0)], np.ones((2, 7)))
    layers = [_Ev(0), _Ev(10), _Ev(30)]
    marks = {"first_layer": layers[0], "layers": layers, "norm": _Ev(40), "end": _Ev(42), "lead_under_a_layer": 2}
    eng.clock.observe(marks | {"host_forward_s": 0.05, "pin_alloc_s": 0.01}, staged)
    eng.clock.close()
    s = eng.stats()
    assert (s["device_forward_s"], s["device_layer_excess_s"], s["lead_under_a_layer"]) == (0.04, 0.01, 2)
    (log,) = tmp_path.glob("forwards-*.jsonl")  # one file per engine
    reset, forward = (json.loads(x) for x in log.read_text().splitlines())
    assert reset == {"reset": True}
    assert (forward["rows"], forward["t"], forward["lengths"]) == (2, 7, [7, 5])
    assert forward["slow_layers"] == [[1, 10.0]]  # the second layer ran 20 ms against a median of 10
    assert (forward["device_ms"], forward["layer_excess_ms"], forward["host_ms"], forward["pin_alloc_ms"]) == (
        40,
        10,
        50,
        10,
    )


def test_the_packed_sequence_shortcut_holds_only_inside_this_engines_forwards(engine):
    """transformers' packed-sequence check waits for the device; the engine answers it for its own rows
    (one sequence each) and leaves it as it was for anyone else in the process."""
    from transformers import masking_utils

    packed = torch.tensor([[0, 1, 2, 0, 1]])
    assert masking_utils.find_packed_sequence_indices(packed).tolist() == [[0, 0, 0, 1, 1]]
    assert masking_utils.find_packed_sequence_indices(torch.arange(5)[None]) is None
    seen = []
    hook = engine.base.layers[0].register_forward_pre_hook(
        lambda *_: seen.append(masking_utils.find_packed_sequence_indices(packed))
    )
    try:
        res = engine.submit("p", list(range(1, 9))).result(timeout=120)
    finally:
        hook.remove()
    assert res.error is None and seen == [None]
    res.capture.release()


# ---- non-finite values ------------------------------------------------------------------------------


class _NaNAt:
    """Forward hooks: remember each forward's input ids; write NaN into decoder layer `layer`'s output (the
    final norm's for None) at position `pos` of the request running `ids` (at the start of its padded row,
    or wherever it lies in a packed one). `pos` may be a padded position."""

    def __init__(self, eng: HFEngine, layer: int, ids: list[int], pos: int):
        self.ids, self.pos, self.hits = ids, pos, 0
        self._rows = None
        self._handles = [
            eng.base.register_forward_pre_hook(self._see, with_kwargs=True),
            (eng.base.norm if layer is None else eng.base.layers[layer]).register_forward_hook(self._poison),
        ]

    def _see(self, _module, _args, kwargs):
        self._rows = kwargs["input_ids"].cpu()

    def _poison(self, _module, _inputs, output):
        hidden = output[0] if isinstance(output, (tuple, list)) else output
        n = len(self.ids)
        want = torch.tensor(self.ids)
        rows, length = self._rows, self._rows.shape[1]
        for row in range(rows.shape[0]):
            for at in range(length - n + 1):
                if at + self.pos < length and torch.equal(rows[row, at : at + n], want):
                    hidden[row, at + self.pos, 7] = float("nan")
                    self.hits += 1

    def remove(self):
        for h in self._handles:
            h.remove()


def _three(eng):
    rng = np.random.default_rng(2)
    return [(f"n{i}", rng.integers(0, eng.vocab_size, size=n).tolist()) for i, n in enumerate((50, 20, 35))]


def test_a_nonfinite_value_is_counted_for_its_request_and_rejects_only_it(any_engine):
    engine = any_engine
    h = engine.base.config.hidden_size
    reqs = _three(engine)
    before = engine.batches
    spy = _NaNAt(engine, AUX[1], reqs[1][1], pos=5)  # a real position of the 20-token request
    try:
        res = _submit_together(engine, reqs)
    finally:
        spy.remove()
    assert engine.batches - before == 1 and spy.hits == 1  # all three in one forward, poisoned once
    reasons = {k: check_capture(res[k].capture, ids, len(AUX) * h, h) for k, ids in reqs}
    assert res["n1"].capture.header.nonfinite > 0
    assert "non-finite" in reasons["n1"]
    assert reasons["n0"] is None and reasons["n2"] is None
    assert res["n0"].capture.header.nonfinite == res["n2"].capture.header.nonfinite == 0
    # The count is exact: every non-finite value the capture holds. Layer 2 (before the NaN) is clean,
    # layer 15 holds the one NaN written; later layers carry it on (attention spreads NaN across the row).
    aux, last = (_bf16(b).numpy() for b in res["n1"].capture.bits())
    bad = ~np.isfinite(aux)
    assert res["n1"].capture.header.nonfinite == bad.sum() + (~np.isfinite(last)).sum()
    assert not bad[:, :h].any()
    assert np.argwhere(bad[:, h : 2 * h]).tolist() == [[5, 7]]


def test_a_nonfinite_value_at_a_padded_position_is_not_counted(engine):
    """NaN in the final state of a padded position of the short request's row: never counted, nobody rejected.

    (Written after the final norm: written into a decoder layer's output, a NaN at a padded position would
    reach the row's real positions through attention, where 0 * NaN is NaN: padding states are finite in
    a real forward because they are computed from the real tokens, which are.)"""
    h = engine.base.config.hidden_size
    reqs = _three(engine)
    before = engine.batches
    spy = _NaNAt(engine, None, reqs[1][1], pos=30)  # the 20-token request's row, padded to 50
    try:
        res = _submit_together(engine, reqs)
    finally:
        spy.remove()
    assert engine.batches - before == 1 and spy.hits == 1
    for key, ids in reqs:
        assert res[key].capture.header.nonfinite == 0, key
        assert check_capture(res[key].capture, ids, len(AUX) * h, h) is None
    # The same NaN at a real position of that row is counted (the hook does reach the stored tensor).
    spy = _NaNAt(engine, None, reqs[1][1], pos=19)
    try:
        res = _submit_together(engine, reqs)
    finally:
        spy.remove()
    assert spy.hits == 1 and res["n1"].capture.header.nonfinite == 1
    assert res["n0"].capture.header.nonfinite == res["n2"].capture.header.nonfinite == 0


# ---- bad ids ----------------------------------------------------------------------------------------


def test_ids_outside_the_vocabulary_negative_or_empty_are_error_results(engine):
    v = engine.vocab_size
    reqs = [("empty", []), ("negative", [1, -1, 2]), ("too_big", [1, v, 2]), ("ok", [1, 2, 3, v - 1])]
    res = engine.capture(reqs)
    assert res["empty"].capture is None and "no tokens" in res["empty"].error
    assert res["negative"].capture is None and "-1" in res["negative"].error
    assert res["too_big"].capture is None and f"{v} outside the vocabulary" in res["too_big"].error
    assert res["ok"].error is None and res["ok"].capture.header.num_tokens == 4
    engine.ensure_alive()
    assert engine.healthy()


# ---- the batching policy ----------------------------------------------------------------------------


def _req(key, n, order):
    return Request(key, [1] * n, Future(), 0.0, order)


class _Policy:
    """take_batch under one policy (a pure function: no engine, no model)."""

    def __init__(self, max_batch_tokens):
        self.policy = BatchPolicy(max_batch_tokens)

    def _take(self, pool):
        return take_batch(pool, self.policy)


def _policy(max_batch_tokens) -> _Policy:
    return _Policy(max_batch_tokens)


def test_take_oldest_group_sets_the_length_and_the_longest_that_fit_fill_the_batch():
    eng = _policy(200)
    pool = [
        _req("a10", 10, 0),
        _req("a50", 50, 0),
        _req("b100", 100, 1),
        _req("b49", 49, 1),
        _req("b30", 30, 1),
        _req("c49", 49, 2),
        _req("c50", 50, 2),
    ]
    batch = eng._take(pool)
    # T = 50 (the longest of order 0); 200 // 50 = 4 requests; then the longest <= 50 from any group,
    # equal lengths by order: b49 before c49; a10 of the oldest group waits (shorter ones fill later).
    assert [r.key for r in batch] == ["a50", "c50", "b49", "c49"]
    assert [r.key for r in pool] == ["a10", "b100", "b30"]
    assert [r.key for r in eng._take(pool)] == ["a10"]  # order 0 is still the oldest: its T is 10
    # 200 // 100 = 2 would fit b30, but 70 padded tokens on 130 real ones is past the padding cap.
    assert [r.key for r in eng._take(pool)] == ["b100"]
    assert [r.key for r in eng._take(pool)] == ["b30"]
    assert pool == []


def test_take_caps_the_batch_at_max_batch_tokens_over_the_longest():
    eng = _policy(1000)
    pool = [_req(f"x{i}", 200 - i, 3) for i in range(10)]
    batch = eng._take(pool)
    assert [len(r.ids) for r in batch] == [200, 199, 198, 197, 196]  # 1000 // 200 = 5, longest first
    # A request longer than max_batch_tokens still runs, alone.
    pool = [_req("long", 5000, 0), _req("short", 3, 0)]
    assert [r.key for r in eng._take(pool)] == ["long"]
    assert [r.key for r in eng._take(pool)] == ["short"]


def test_take_stops_filling_where_padding_would_pass_the_cap():
    """Padding stays within max_padding of the real tokens, once the forward holds min_fill of the budget."""
    eng = _policy(round(250 / BatchPolicy(1).min_fill))  # min_fill of it is 250 padded tokens
    pool = [_req(k, n, 0) for k, n in (("p100", 100), ("p99", 99), ("p60", 60), ("p58", 58), ("p57", 57))]
    # 100 + 99 pad 1; p60 would pad 40 (past 3 %) but the forward holds only 200 of the 250 padded
    # tokens, so it still goes in; p58 then stops the fill (300 >= 250).
    assert [r.key for r in eng._take(pool)] == ["p100", "p99", "p60"]
    assert [r.key for r in eng._take(pool)] == ["p58", "p57"]
    assert eng.policy.max_padding == 0.03


def test_the_fill_floor_is_the_forward_whose_device_time_equals_the_hosts_launch():
    # 130 ms to launch, 31.4 us a padded token on the device: 4,140 tokens, a quarter of 16,384.
    assert fill_share(0.130, 31.4e-6, 16384) == pytest.approx(4140 / 16384, rel=1e-3)
    assert fill_share(0.130, 31.4e-6, 65536) == 0.125  # never below the unmeasured floor
    assert fill_share(2.0, 31.4e-6, 16384) == 0.5  # a slow host does not turn every forward into padding
    assert fill_share(0.0, 31.4e-6, 16384) == BatchPolicy.min_fill  # nothing measured
    assert fill_share(0.1, 0.0, 16384) == BatchPolicy.min_fill


def test_the_fill_floor_follows_the_launch_cost_the_job_measures_not_the_warm_ups_alone():
    floor = FillFloor(16384, window=8)
    assert floor.share == BatchPolicy.min_fill  # nothing measured yet
    floor.observe(0.150, 0.514, 16384)  # a full forward: device-bound, 31.4 us a padded token
    floor.observe(0.060, 0.008, 256)  # the warm-up's small forward, launched alone: 60 ms
    assert floor.share == 0.125  # 60 ms / 31.4 us = 1,911 tokens: below the minimum
    # In the job the same launch takes ~190 ms (threads contending for the interpreter): the floor follows.
    for _ in range(8):
        floor.observe(0.190, 0.070, 2200)
    assert floor.share == pytest.approx(0.190 / 31.4e-6 / 16384, rel=1e-3)
    floor.observe(0.200, 0.250, 6000)  # device-bound and below half the budget: tells neither
    assert floor.share == pytest.approx(0.190 / 31.4e-6 / 16384, rel=1e-3)


def test_a_forward_queued_behind_earlier_work_does_not_count_as_a_launch():
    floor = FillFloor(16384, window=8)
    floor.observe(0.150, 0.514, 16384)  # 31.4 us a padded token
    floor.observe(0.040, 0.008, 256)  # launched onto an idle device: 40 ms
    # Small forwards right behind full ones: the host's time is mostly the full one's device time, spent
    # blocked on CUDA's launch queue. They say nothing of the launch, and the floor stays where it was.
    for _ in range(8):
        floor.observe(0.430, 0.060, 2048, device_waited=False)
    assert floor.launch_s[-1] == 0.040 and len(floor.launch_s) == 1
    assert floor.share == 0.125
    # The same forwards with the device idle before them were host-bound: they count.
    for _ in range(8):
        floor.observe(0.190, 0.070, 2200, device_waited=True)
    assert floor.share == pytest.approx(0.190 / 31.4e-6 / 16384, rel=1e-3)


def test_a_configured_fill_floor_stays_whatever_the_forwards_measure():
    eng = HFEngine("unused", (1,), device="cpu", max_batch_tokens=1000, fill_floor=1.0)
    assert eng.policy.min_fill == 1.0
    eng._floor.observe(0.150, 0.514, 1000)
    eng._floor.observe(0.040, 0.008, 100)
    assert eng._floor.share != 1.0 and eng.policy.min_fill == 1.0
    pool = [_req(k, n, 0) for k, n in (("p100", 100), ("p60", 60), ("p20", 20))]
    assert [r.key for r in take_batch(pool, eng.policy)] == ["p100", "p60", "p20"]  # fills past any padding


def test_the_fill_floor_defaults_per_device_and_comes_from_the_config():
    from conf.schema import load_config

    assert HFEngine("unused", (1,), device="cpu").policy.min_fill == BatchPolicy.min_fill  # padding is all cost
    assert HFEngine("unused", (1,), device="cuda").policy.min_fill == HFEngine.CUDA_FILL_FLOOR == 1.0
    measured = HFEngine("unused", (1,), device="cuda", fill_floor="measured")
    assert measured.fill_floor is None and measured.policy.min_fill == BatchPolicy.min_fill  # until measured
    for value, expected in (("measured", "measured"), ("0.5", 0.5), ("null", None)):
        cfg = load_config("conf/default.yaml", ["engine.name=hf", f"debug.fill_floor={value}"])
        assert (
            HFEngine.kwargs_for(cfg.engine, "m", (1,), True, 2, debug=cfg.debug.model_dump())["fill_floor"] == expected
        )
    with pytest.raises(Exception, match=r"debug\.fill_floor"):
        load_config("conf/default.yaml", ["debug.fill_floor=1.5"])


def test_the_engines_batches_fill_to_its_measured_floor():
    eng = HFEngine("unused", (1,), device="cpu", max_batch_tokens=1000)
    assert eng.policy.min_fill == BatchPolicy.min_fill
    eng._floor.share = 0.5  # as the warm-up's measurement sets it on CUDA
    pool = [_req(k, n, 0) for k, n in (("p100", 100), ("p60", 60), ("p58", 58), ("p57", 57), ("p56", 56))]
    # Past the padding cap from p60 on, but the forward fills on until it holds 500 padded tokens.
    assert [r.key for r in take_batch(pool, eng.policy)] == ["p100", "p60", "p58", "p57", "p56"]
    lengths = (("p100", 100), ("p60", 60), ("p58", 58), ("p57", 57), ("p56", 56))
    # The unmeasured floor (125 tokens) lets p60 in and stops at p58.
    assert [r.key for r in take_batch([_req(k, n, 0) for k, n in lengths], BatchPolicy(1000))] == ["p100", "p60"]


def test_requests_of_one_caller_batch_complete_before_a_later_batch_of_longer_requests(engine):
    """Through the worker: the oldest order goes first even when a later order holds longer requests."""
    rng = np.random.default_rng(3)
    done: list[str] = []
    with engine._cv:
        futs = [engine.submit(f"late{i}", rng.integers(0, 1000, size=60).tolist(), order=2) for i in range(2)]
        futs += [
            engine.submit(f"early{i}", rng.integers(0, 1000, size=n).tolist(), order=1) for i, n in enumerate((30, 8))
        ]
        for f in futs:
            f.add_done_callback(lambda f: done.append(f.result().key))
    for f in futs:
        f.result(timeout=120)
    assert set(done[:2]) == {"early0", "early1"}, done


# ---- warm-up --------------------------------------------------------------------------------------


def test_warm_up_runs_one_full_forward_and_counts_nothing(model_dir):
    """On by default on CUDA only; forced here. One forward of max_batch_tokens, then counters from zero."""
    with HFEngine(str(model_dir), AUX, max_batch_tokens=512, cpu_threads=2, warmup=True) as eng:
        assert eng.stats()["forwards"] == 0 and eng.stats()["real_tokens"] == 0
        res = eng.submit("a", list(range(1, 40))).result(timeout=120)
        assert res.error is None and res.capture.header.num_tokens == 39
        res.capture.release()
        assert eng.stats()["forwards"] == 1 and eng.stats()["real_tokens"] == 39
        # Where the start went, as the start-up line names it: the model's parts in their order, inside the load.
        parts = eng.phases["load_parts_s"]
        assert list(parts) == ["import", "read", "to device"]  # CPU, packing off: no checks
        # Each part and the load are rounded to the millisecond on their own: half a millisecond each may add up.
        slack = 0.0005 * (len(parts) + 1)
        assert all(v >= 0 for v in parts.values()) and sum(parts.values()) <= eng.phases["load_s"] + slack
        assert eng.phases["warm_up_s"] > 0
    assert HFEngine("unused", AUX).warmup is None  # decided at start: the device is known then


def test_warm_up_refuses_a_max_batch_tokens_the_device_cannot_hold(model_dir, monkeypatch):
    import torch

    real = HFEngine._forward

    def small_device(self, batch):  # any forward of more than one sequence runs out of memory
        if len(batch) > 1:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory (simulated)")
        return real(self, batch)

    monkeypatch.setattr(HFEngine, "_forward", small_device)
    monkeypatch.setattr(HFEngine, "WARMUP_MAX_LENGTH", 64)  # 2 x 64 tokens, not 2 x 2048: seconds less on a CPU
    eng = HFEngine(str(model_dir), AUX, max_batch_tokens=128, cpu_threads=2, warmup=True)
    with pytest.raises(
        RuntimeError, match=r"engine.max_batch_tokens=128 does not fit .* 2 x 64 .* lower engine.max_batch_tokens"
    ):
        eng.start()
    assert not eng.healthy()  # the failed start closed what it had started


# ---- close() ----------------------------------------------------------------------------------------


def test_close_resolves_requests_still_waiting(model_dir):
    eng = HFEngine(str(model_dir), AUX, cpu_threads=2).start()
    entered, go = threading.Event(), threading.Event()

    def hold(_module, _args):
        entered.set()
        assert go.wait(60)

    handle = eng.base.register_forward_pre_hook(hold)
    closer = None
    try:
        first = eng.submit("first", [1, 2, 3])
        assert entered.wait(60)  # the worker is inside the first forward
        waiting = [eng.submit(f"w{i}", [4, 5, 6, i + 7]) for i in range(3)]
        closer = threading.Thread(target=eng.close)
        closer.start()
        deadline = time.monotonic() + 30
        while not eng._closing and time.monotonic() < deadline:
            time.sleep(0.01)
        assert eng._closing
    finally:
        go.set()
        if closer is not None:
            closer.join(60)
        handle.remove()
    assert not closer.is_alive()
    assert first.result(timeout=1).error is None and first.result().capture.header.num_tokens == 3
    for f in waiting:
        r = f.result(timeout=1)
        assert r.capture is None and r.error == "engine closed before the request ran"
    assert not eng.healthy()
    with pytest.raises(EngineDied, match="not started"):
        eng.submit("after", [1])


# ---- states() ---------------------------------------------------------------------------------------


def test_float32_states_match_the_bf16_capture_within_bf16_noise(engine, model_dir, text_ids):
    from pipeline.tools.fidelity import DEFAULT_RULE, FINAL_DEPTH

    h = engine.base.config.hidden_size
    caps = engine.capture([(str(i), ids) for i, ids in enumerate(text_ids)])
    with (
        ReferenceStates(str(model_dir), AUX, dtype="float32", max_batch_tokens=1024, cpu_threads=2) as ref,
        ReferenceStates(str(model_dir), AUX, dtype="bfloat16", max_batch_tokens=1024, cpu_threads=2) as yard,
    ):
        before = ref.batches
        states = ref.states(text_ids)
        assert ref.batches - before < len(text_ids)  # batched by length, results in request order
        alone = ref.states([text_ids[0]])[0]
        yardsticks = yard.states(text_ids)
    worst = 0.0
    for i, (ids, (aux, last), (y_aux, y_last)) in enumerate(zip(text_ids, states, yardsticks)):
        n = len(ids)
        assert aux.dtype == last.dtype == torch.float32
        assert aux.shape == (n, len(AUX) * h) and last.shape == (n, h)
        got_aux, got_last = caps[str(i)].capture.bits()
        cols = [slice(k * h, (k + 1) * h) for k in range(len(AUX))]
        refs = [aux[:, c] for c in cols] + [last]
        yards = [y_aux[:, c] for c in cols] + [y_last]
        gots = [_bf16(got_aux)[:, c] for c in cols] + [_bf16(got_last)]
        for d in DEFAULT_RULE.judge_layers(gots, refs, yards, [*AUX, FINAL_DEPTH]):
            assert d.passed, (i, d.why())
            worst = max(worst, d.sample_ratio)
    # float32 batched with padding equals float32 alone (up to summation order).
    assert _cos(alone[0], states[0][0]).min().item() > 0.99999 and _cos(alone[1], states[0][1]).min().item() > 0.99999
    print(f"states() float32 vs bf16 capture: worst sample/layer {worst:.2f}x a bf16 forward's distance")


def test_the_reference_refuses_unknown_dtypes():
    with pytest.raises(ValueError, match="dtype"):
        ReferenceStates("unused", AUX, dtype="float16")


def test_an_fp8_capture_is_the_codecs_quantization_of_the_bf16_capture(model_dir, text_ids, engine):
    """capture_layout=fp8: the engine's body is exactly the codec's quantization of the states the bf16 engine
    captures for the same tokens (the same forward, batched alike), and validates as fp8 only."""
    from pipeline.format.codec import Codec

    requests = [("a", list(text_ids[0])), ("b", list(text_ids[0])[:37])]
    want = engine.capture(requests)
    with HFEngine(str(model_dir), AUX, max_batch_tokens=4096, cpu_threads=2, capture_layout="fp8") as eng:
        got = eng.capture(requests)
    h = want["a"].capture.header.last_shape[1]
    codec = Codec("fp8", block=h)
    for key, ids in requests:
        cap, ref = got[key].capture, want[key].capture
        assert cap.header.layout == "fp8"
        assert check_capture(cap, ids, len(AUX) * h, h, layout="fp8") is None
        assert check_capture(cap, ids, len(AUX) * h, h, layout="planes") is not None
        aux, last = ref.bits()
        np.testing.assert_array_equal(cap.aux, codec.body_from_bits(aux))
        np.testing.assert_array_equal(cap.last, codec.body_from_bits(last))


def test_cudnn_attention_is_kept_from_a_forward_shape_until_it_comes_back():
    """ "warm": a new forward shape with light attention runs without cuDNN's kernel (whose per-shape plan would
    be built on the forward thread), a heavy one and the same shape again with torch's own choice; "always" and
    a CPU never narrow it."""
    from actors.hf.decoder import Decoder

    assert torch.backends.cuda.cudnn_sdp_enabled()
    dec = Decoder("m", AUX, "cuda", "bfloat16", cudnn_attention="warm")  # nothing loaded: the policy alone
    with dec._attention((4, 512)):
        assert not torch.backends.cuda.cudnn_sdp_enabled()
        assert torch.backends.cuda.flash_sdp_enabled()
    assert torch.backends.cuda.cudnn_sdp_enabled()  # restored once the forward is done
    with dec._attention((4, 512)):  # the shape came back: torch decides
        assert torch.backends.cuda.cudnn_sdp_enabled()
    with dec._attention((4, 513)):  # another length is another shape
        assert not torch.backends.cuda.cudnn_sdp_enabled()
    with dec._attention((8, 2048)):  # a full forward of 2,048-token rows: the most flash takes
        assert not torch.backends.cuda.cudnn_sdp_enabled()
    with dec._attention((2, 6144)):  # long rows: flash's extra time would pass cuDNN's plan
        assert torch.backends.cuda.cudnn_sdp_enabled()
    for other in (
        Decoder("m", AUX, "cuda", "bfloat16", cudnn_attention="always"),
        Decoder("m", AUX, "cpu", "bfloat16", cudnn_attention="warm"),
    ):
        with other._attention((2, 64)):
            assert torch.backends.cuda.cudnn_sdp_enabled()
    with pytest.raises(ValueError, match="cudnn_attention 'never'"):
        Decoder("m", AUX, "cuda", "bfloat16", cudnn_attention="never")


def test_cudnn_attention_comes_from_the_config_and_is_recorded_on_cuda():
    from bench.bare_hf import BareHFEngine
    from conf import load_config

    for value in ("warm", "always"):
        cfg = load_config("conf/default.yaml", ["engine.name=hf", f"debug.cudnn_attention={value}"])
        kwargs = HFEngine.kwargs_for(cfg.engine, "m", AUX, True, 2, debug=cfg.debug.model_dump())
        assert kwargs["cudnn_attention"] == value
        assert HFEngine.provenance(kwargs, cuda=True)["cudnn_attention"] == value
        assert "cudnn_attention" not in HFEngine.provenance(kwargs | {"device": "cpu"}, cuda=False)
    assert load_config("conf/default.yaml", ["engine.name=hf"]).debug.cudnn_attention == "warm"
    with pytest.raises(Exception, match="debug.cudnn_attention"):
        load_config("conf/default.yaml", ["engine.name=hf", "debug.cudnn_attention=never"])
    # The benchmarks' baseline keeps torch's choice: its repeated passes run every shape on a built plan.
    assert BareHFEngine("m", AUX).decoder.cudnn_attention == "always"
    assert HFEngine("m", AUX).decoder.cudnn_attention == "warm"


# ---- the debug section -------------------------------------------------------------------------------


def test_the_debug_sections_values_reach_the_engine_through_the_drivers_kwargs(repo_root, tmp_path, monkeypatch):
    """debug.forward_log and debug.pinned_slabs go the engine section's way (the driver's extractor_kwargs);
    the environment is not read for them."""
    import types

    from conf import load_config
    from pipeline.driver.job import extractor_kwargs
    from pipeline.format.shards import ShardLayout

    monkeypatch.setenv("HIDDEN_HARVEST_PINNED_SLABS", "3")
    monkeypatch.setenv("HIDDEN_HARVEST_FORWARD_LOG", str(tmp_path / "env"))
    plan = types.SimpleNamespace(model_dir="m", cuda=True, layout=ShardLayout(AUX, 576))
    default = repo_root / "conf" / "default.yaml"
    kwargs = extractor_kwargs(load_config(default, ["engine.name=hf"]), plan)["engine_kwargs"]
    assert (kwargs["forward_log"], kwargs["pinned_slabs"], kwargs["fill_floor"]) == (None, None, None)
    eng = HFEngine(**kwargs)  # nothing touches a device before start()
    assert eng.clock.forward_log is None and eng.copier.slab_limit == HFEngine.PINNED_SLABS
    sets = ["engine.name=hf", f"debug.forward_log={tmp_path}", "debug.pinned_slabs=0"]
    kwargs = extractor_kwargs(load_config(default, sets), plan)["engine_kwargs"]
    eng = HFEngine(**kwargs)
    assert eng.clock.forward_log == str(tmp_path) and eng.copier.slab_limit == 0
    # The SGLang engine takes the same section and reads none of it.
    assert "forward_log" not in str(extractor_kwargs(load_config(default, sets[1:]), plan)["engine_kwargs"])


# ---- the benchmarks' baseline ------------------------------------------------------------------------


def test_the_bare_engine_runs_the_same_forwards_and_keeps_nothing(model_dir):
    """bench/bare_hf.py: the engine's public discard mode, the forwards batched as the capturing engine's."""
    from bench.bare_hf import BareHFEngine

    rng = np.random.default_rng(4)
    reqs = [(f"b{i}", rng.integers(0, 1000, size=n).tolist()) for i, n in enumerate((40, 12, 33, 7))]
    with BareHFEngine(str(model_dir), AUX, max_batch_tokens=4096, cpu_threads=2) as bare:
        assert bare.outputs.keeps is False
        res = _submit_together(bare, reqs)
        assert bare.decoder._taken == {}  # the hooks kept nothing
        s = bare.stats()
    assert all(r.capture is None and r.error is None and r.latency_s > 0 for r in res.values())
    assert (s["forwards"], s["real_tokens"]) == (1, 92)
    with pytest.raises(ValueError, match="outputs 'keep'"):
        HFEngine("m", AUX, outputs="keep")

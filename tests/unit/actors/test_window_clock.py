"""The SGLang engine's window clock: how full the capture window was (reported in the manifest's engine stats)."""

from __future__ import annotations

import pytest

import actors.sglang.window as window_module
from actors.sglang.window import WindowClock


def test_idle_short_and_mean_in_flight_follow_the_requests(monkeypatch):
    clock = WindowClock(size=2)
    clock.reset(now=0.0)
    clock.change(+1, 1.0)  # 0-1 s: nothing in flight
    clock.change(+1, 2.0)  # 1-2 s: one
    clock.change(-1, 4.0)  # 2-4 s: full
    clock.change(-1, 5.0)  # 4-5 s: one
    monkeypatch.setattr(window_module.time, "monotonic", lambda: 6.0)  # 5-6 s: idle again
    snap = clock.snapshot()
    assert snap["requests"] == 2 and snap["size"] == 2
    assert snap["seconds"] == pytest.approx(6.0)
    assert snap["idle_s"] == pytest.approx(2.0)
    assert snap["short_of_full_s"] == pytest.approx(4.0)
    assert snap["mean_in_flight"] == pytest.approx((1 + 2 * 2 + 1) / 6, abs=0.01)


def test_the_stretch_since_the_last_change_counts_at_its_level(monkeypatch):
    clock = WindowClock(size=1)
    clock.reset(now=10.0)
    clock.change(+1, 10.0)
    monkeypatch.setattr(window_module.time, "monotonic", lambda: 13.0)
    snap = clock.snapshot()
    assert snap["idle_s"] == 0 and snap["short_of_full_s"] == 0 and snap["mean_in_flight"] == pytest.approx(1.0)
    clock.reset(now=20.0)  # after warm-up: nothing before counts
    monkeypatch.setattr(window_module.time, "monotonic", lambda: 21.0)
    assert clock.snapshot()["requests"] == 0 and clock.snapshot()["idle_s"] == pytest.approx(1.0)

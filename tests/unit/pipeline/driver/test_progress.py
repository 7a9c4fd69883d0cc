import json
from types import SimpleNamespace

import pytest

from pipeline.driver import progress as progress_mod
from pipeline.driver.progress import Progress, human_duration
from pipeline.format.storage import human_bytes


@pytest.fixture
def clock(monkeypatch):
    # `started` defaults to the real clock, so tests pass started=clock.t explicitly.
    now = SimpleNamespace(t=100.0)
    monkeypatch.setattr(progress_mod, "time", SimpleNamespace(monotonic=lambda: now.t))
    return now


def test_counts_by_status(clock):
    p = Progress(total_samples=10, total_tokens=1000, started=clock.t)
    p.update(["ok", "ok", "error", "filtered"], [100, 200, 50, 30], [1500, 2500, 0, 0])
    assert (p.done, p.ok, p.errors, p.filtered) == (4, 2, 1, 1)
    assert (p.tokens, p.bytes, p.processed_tokens) == (300, 4000, 380)


def test_line_format(clock):
    p = Progress(total_samples=10, total_tokens=1000, started=clock.t)
    p.update(["ok", "ok", "error", "filtered"], [100, 200, 50, 30], [1500, 2500, 0, 0])
    clock.t += 10.0
    # 300 committed tokens in 10 s; 620 tokens left -> 20.67 s.
    assert p.line() == "4/10 (40.0%) | 0.40 samples/s | 30 tok/s | ETA 20s | errors 1 | 4.00 KB written"


def test_line_eta_unknown_before_first_token_and_zero_when_done(clock):
    p = Progress(total_samples=1_234, total_tokens=5_000_000, started=clock.t)
    clock.t += 1.0
    assert p.line() == "0/1,234 (0.0%) | 0.00 samples/s | 0 tok/s | ETA ? | errors 0 | 0 B written"
    p.update(["ok"] * 1_234, [5_000_000 // 1_234 + 1] * 1_234, [1_000_000] * 1_234)
    line = p.line()
    assert line.startswith("1,234/1,234 (100.0%)") and "ETA 0s" in line and line.endswith("1.23 GB written")


def test_empty_run_is_complete(clock):
    assert Progress(total_samples=0, total_tokens=0, started=clock.t).line().startswith("0/0 (100.0%)")


@pytest.mark.parametrize(
    "n, text",
    [
        (0, "0 B"),
        (999, "999 B"),
        (1000, "1.00 KB"),
        (1500, "1.50 KB"),
        (2_500_000, "2.50 MB"),
        (3 * 10**9, "3.00 GB"),
        (4 * 10**12, "4.00 TB"),
        (5 * 10**15, "5,000.00 TB"),
    ],
)
def test_human_bytes(n, text):
    assert human_bytes(n) == text


def test_human_bytes_rounds_up_into_next_unit():
    assert human_bytes(999_999) == "1.00 MB"


@pytest.mark.parametrize(
    "s, text", [(0, "0s"), (59.9, "59s"), (61, "1m01s"), (3600, "1h00m"), (7325, "2h02m"), (-5, "0s")]
)
def test_human_duration(s, text):
    assert human_duration(s) == text


def test_maybe_log_respects_interval(clock, caplog):
    p = Progress(total_samples=2, total_tokens=10, interval_s=10.0, started=clock.t)
    with caplog.at_level("INFO", logger="pipeline.driver.progress"):
        p.maybe_log(force=True)
        clock.t += 5.0
        p.maybe_log()
        clock.t += 5.0
        p.maybe_log()
    assert [r.getMessage() for r in caplog.records] == [p.line()] * 2


def test_rate_after_engine_start_and_per_actor_shares(clock, monkeypatch):
    wall = SimpleNamespace(t=1000.0)
    monkeypatch.setattr(progress_mod, "time", SimpleNamespace(monotonic=lambda: clock.t, time=lambda: wall.t))
    p = Progress(total_samples=4, total_tokens=400, started=clock.t)
    assert p.tokens_per_second_after_engine_start() is None
    wall.t = 1010.0
    statuses, tokens = ["ok", "ok", "error"], [100, 50, 30]
    p.update(statuses, tokens, [1, 1, 0])
    p.update_actors(["a:1", "b:2", "b:2"], [1002.0, 1000.0, 1000.0], statuses, tokens)
    wall.t = 1020.0
    p.update(["ok"], [150], [1])
    p.update_actors(["a:1"], [1002.0], ["ok"], [150], [1003.5])
    p.update_actors(["a:1"], [1002.0], ["ok"], [0], [1009.0])  # a later batch: the first one's gap stays
    assert p.actors == {
        "a:1": {"samples": 3, "tokens": 250, "first_batch_after_ready_s": 1.5},
        "b:2": {"samples": 1, "tokens": 50},
    }
    # Engine counters are cumulative: the latest wins, whatever order batches come back in.
    later, earlier = json.dumps({"forwards": 9, "idle_s": 1.0}), json.dumps({"forwards": 4, "idle_s": 0.5})
    p.update_actors(["b:2", "b:2"], [1000.0] * 2, ["error"] * 2, [0, 0], [1011.0] * 2, [later, later])
    p.update_actors(["b:2"], [1000.0], ["error"], [0], [1010.5], [earlier])
    p.update_actors(["b:2"], [1000.0], ["error"], [0], [1012.0], [""])  # an engine without counters
    assert p.actors["b:2"]["engine"] == {"forwards": 9, "idle_s": 1.0}
    # Batches finishing after the last forward share its count: the one committed last wins, in any order.
    last = json.dumps({"forwards": 9, "batch_committed_unix": 1015.0})
    before = json.dumps({"forwards": 9, "batch_committed_unix": 1014.0})
    p.update_actors(["b:2", "b:2"], [1000.0] * 2, ["error"] * 2, [0, 0], [1011.0] * 2, [last, before])
    assert p.actors["b:2"]["engine"] == {"forwards": 9, "batch_committed_unix": 1015.0}
    # 300 committed tokens from the first engine up (t=1000) to the last result (t=1020); errors add nothing.
    assert p.tokens_per_second_after_engine_start() == pytest.approx(15.0)


def test_startup_names_each_part_for_the_engine_ready_last():
    from pipeline.driver.progress import startup, startup_line

    t = 1_000.0
    actors = {
        "h:1": {
            "engine": {"start": {"actor_init_unix": t + 2, "ready_unix": t + 20, "load_s": 15.0, "warm_up_s": 3.0}}
        },
        "h:2": {
            "engine": {"start": {"actor_init_unix": t + 5, "ready_unix": t + 30, "load_s": 20.0, "warm_up_s": 5.0}}
        },
        "h:3": {"engine": {"forwards": 3}},  # an engine that reports no start: left out
    }
    s = startup(4.2, 8.05, t, actors)
    assert s == {
        "ray_s": 4.2,
        "read_and_tokenize_s": 8.05,
        "actor_s": 5.0,
        "engine_load_s": 20.0,
        "warm_up_s": 5.0,
        "engines_ready_after_s": 30.0,
    }
    line = startup_line(s)
    assert line == (
        "start-up: Ray 4.2 s, read and tokenize 8.1 s, actor 5.0 s, engine load 20.0 s, warm-up 5.0 s "
        "(the engine ready last)"
    )
    # An engine that splits its load (the hf engine): the parts follow the load, in the engine's order.
    parts = {"import": 7.0, "read": 0.45, "to device": 1.9, "packing check": 0.55, "staging check": 6.0}
    actors["h:2"]["engine"]["start"]["load_parts_s"] = dict(parts)
    s = startup(4.2, 8.05, t, actors)
    assert s["engine_load_parts_s"] == parts
    assert (
        "engine load 20.0 s (import 7.0 s, read 0.5 s, to device 1.9 s, packing check 0.6 s, staging check 6.0 s), "
        "warm-up 5.0 s"
    ) in startup_line(s)
    # Ray already running in the process (tests, notebooks), and no engine reported yet (nothing to extract).
    assert startup_line(startup(None, 1.0, t, {})) == "start-up: Ray already running, read and tokenize 1.0 s"

"""Two actors, one job: the work is split between them and every sample is committed exactly once.

The transformers engine runs in the actors' own processes, so two of them fit the 2-core test machine
(two SGLang servers are exercised by the stress run, `make test-stress`).
"""

from __future__ import annotations

import json

import pytest

from pipeline.format.manifest import read_manifest
from pipeline.format.shards import open_shards
from pipeline.format.storage import Store
from pipeline.tools.verify import verify

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def two_actor_run(ray_session, e2e_input, make_config, tmp_path_factory):
    from pipeline.driver.job import run

    out = tmp_path_factory.mktemp("two-actors") / "out"
    cfg = make_config(
        e2e_input,
        out,
        **{
            "engine.name": "hf",
            "engine.num_actors": 2,
            "engine.cpus_per_actor": 0.5,
            "engine.cpu_threads": 1,
            "extract.batch_size": 2,
        },
    )
    return out, run(cfg)


def test_two_actors_share_the_work(two_actor_run):
    out, summary = two_actor_run
    per_actor = read_manifest(Store(str(out)))["last_run"]["per_actor"]
    assert len(per_actor) == 2, per_actor
    samples = [a["samples"] for a in per_actor.values()]
    # Batches go to whichever actor has room; both engines are up before the first batch is handed
    # out, so neither may be left with only a token share.
    assert min(samples) >= summary.totals["samples_ok"] // 4, per_actor
    assert sum(samples) == summary.totals["samples_ok"]


def test_two_actors_commit_every_sample_exactly_once(two_actor_run, e2e_input):
    out, summary = two_actor_run
    t = summary.totals
    ids = [s["sample_id"] for s in open_shards(str(out), as_torch=False)]
    assert len(ids) == len(set(ids)) == t["samples_ok"] > 0
    errors = [
        json.loads(line)["sample_id"]
        for f in (out / "errors").glob("part-*.jsonl")
        for line in f.read_text().splitlines()
    ]
    assert not set(errors) & set(ids)
    assert (
        t["accounted"]
        == t["samples"]
        == t["input_rows"]
        == len([line for line in e2e_input.read_text().splitlines() if line.strip()])
    )
    report = verify(str(out))
    assert report.ok, report.problems


def test_an_actor_killed_mid_run_is_restarted_and_its_batch_retried(ray_session, e2e_input, make_config, tmp_path):
    """kill -9 of the extractor actor once the first shard is committed (the transformers engine: a restart costs a
    model load, not a server start): Ray restarts it and retries its batch, and every input row is accounted
    for once. The whole-job version with the SGLang engine is tests/e2e/test_actor_faults.py (make test-long)."""
    import os
    import signal
    import threading
    import time

    from pipeline.driver.job import run
    from tests_support import processes_matching

    out = tmp_path / "out"
    cfg = make_config(e2e_input, out, **{"engine.name": "hf", "engine.cpu_threads": 1, "extract.batch_size": 2})
    killed: list[int] = []
    started = time.time()

    def kill_once_a_shard_is_committed():
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline and not list((out / "shards").glob("part-*.parquet")):
            time.sleep(0.2)
        # Only this test's own Ray workers (descendants of this process): never another job's on the machine.
        for p in processes_matching("HiddenStateExtractor", under=os.getpid(), since=started - 1):
            p.send_signal(signal.SIGKILL)
            killed.append(p.pid)

    killer = threading.Thread(target=kill_once_a_shard_is_committed, daemon=True)
    killer.start()
    summary = run(cfg)
    killer.join(timeout=5)
    assert len(killed) == 1, killed  # the run's one actor, killed while it worked
    t = summary.totals
    rows = [line for line in e2e_input.read_text().splitlines() if line.strip()]
    assert t["accounted"] == t["input_rows"] == len(rows)
    ids = [s["sample_id"] for s in open_shards(str(out), as_torch=False)]
    assert len(ids) == len(set(ids)) == t["samples_ok"] > 0
    per_actor = read_manifest(Store(str(out)))["last_run"]["per_actor"]
    assert [a for a in per_actor if not a.endswith(f":{killed[0]}")], per_actor  # its restart did the rest
    report = verify(str(out))
    assert report.ok, report.problems

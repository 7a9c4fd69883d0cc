"""Resume at scale: the committed-ids index on a real S3 endpoint, planning memory, and a whole job killed and
rerun. Small versions run in the default suite (seconds); the full sizes with `make test-stress` (the
benchmarks' figures: bench/bench_resume_s3.py, bench/bench_plan_scale.py) and `make test-long` (the job)."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))


def _resume_on_s3(shards: int, per_shard: int, threads: int) -> dict:
    import s3fs

    from bench.bench_resume_s3 import build_output, checkpoint_as_the_driver_does, resume_once, tokenized_input
    from pipeline.format.ids_index import INDEX_DIR, compact
    from pipeline.format.storage import Store

    fs = s3fs.S3FileSystem()
    if not fs.exists("hh-scale"):
        fs.mkdir("hh-scale")
    url = f"s3://hh-scale/out-{shards}-{time.time_ns()}"
    build_output(url, shards, per_shard, 16)
    tokenized = tokenized_input(shards, per_shard, max(1, shards * per_shard // 100))
    runs = {"entries": resume_once(tokenized, url, 32, threads)}
    checkpoint_as_the_driver_does(url, shards, per_shard, 256)
    runs["checkpointed"] = resume_once(tokenized, url, 32, threads)
    compact(Store(url), threads)
    runs["compacted"] = resume_once(tokenized, url, 32, threads)
    fs.rm(url.removeprefix("s3://") + f"/{INDEX_DIR}", recursive=True)
    runs["none"] = resume_once(tokenized, url, 32, threads)
    for r in runs.values():  # the same answer whichever way the ids were learned
        assert r["committed_samples"] == shards * per_shard
        assert r["to_do"] == max(1, shards * per_shard // 100)
    assert runs["entries"]["index"]["read_from_files"] == 0 and runs["compacted"]["index"]["entries"] == 1
    assert runs["checkpointed"]["index"]["read_from_files"] == 0
    assert runs["checkpointed"]["index"]["entries"] == -(-shards // 256)
    assert runs["none"]["index"]["read_from_files"] == runs["none"]["index"]["files"]
    return runs


def test_resume_on_s3_gives_the_same_plan_with_or_without_the_index(ray_session, s3_endpoint):
    _resume_on_s3(shards=120, per_shard=20, threads=8)


@pytest.mark.stress
def test_resume_on_s3_with_ten_thousand_shards_reaches_the_first_batch_within_a_minute(ray_session, s3_endpoint):
    runs = _resume_on_s3(shards=10_000, per_shard=100, threads=32)
    assert runs["checkpointed"]["to_first_batch_s"] <= 60, runs
    assert runs["compacted"]["to_first_batch_s"] <= 60, runs


@pytest.mark.stress
def test_planning_a_million_rows_keeps_the_driver_under_two_gigabytes(tmp_path):
    out = tmp_path / "plan_scale.json"
    cmd = [sys.executable, str(REPO / "bench" / "bench_plan_scale.py"), "--rows", "1000000", "--out", str(out)]
    subprocess.run(cmd, check=True, cwd=REPO, timeout=3600)
    figures = json.loads(out.read_text())["runs"]["this checkout"]["1000000"]
    assert figures["driver_peak_rss_mb"] <= 2000, figures
    assert figures["to_do"] == figures["samples"] - figures["duplicate_samples"]


@pytest.mark.long
def test_a_hundred_thousand_rows_killed_midway_and_rerun_are_each_stored_once(tmp_path):
    """The whole job on 100k short pre-tokenized rows (1 % duplicate ids) through the real engine: the driver is
    killed once a tenth of the shards are committed, the rerun completes, every row exactly once
    (bench/bench_kill_rerun.py, whose figures are bench/results/kill_rerun_cpu.json)."""
    from bench.bench_kill_rerun import kill_and_rerun

    r = kill_and_rerun(100_000, 0.1, tmp_path)
    assert r["first_run"]["shards_at_kill"] < r["totals"]["shards"], r
    assert r["totals"]["input_rows"] == r["totals"]["accounted"] == 100_000, r
    assert r["verify"]["ok"], r["verify"]
    assert r["stored_samples"] == r["distinct_ids"] and r["stored_twice"] == r["missing"] == r["mispaired"] == 0, r

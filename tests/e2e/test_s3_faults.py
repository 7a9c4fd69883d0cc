"""A flaky object store, then one that vanishes: retries absorb the errors, the vanished endpoint ends with one
clear line after bounded retries, and nothing partial is left. Writes go to S3 (moto's real HTTP server)
through tests/s3_chaos.py's proxy, which answers a share of requests `503 SlowDown` and can close its port.

- In the suite: the shard writer itself, in this process (seconds).
- Marked `long` (make test-long): the whole job mid-run, then a rerun that completes with every sample
  exactly once; credentials appear nowhere (not printed or logged by the job, not in the output, not in
  Ray's logs).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from tests_support import harvest_command, sets

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[2]
SECRETS = ("hh-test-secret", "hh-test-key")


def _harvest(src, out) -> list[str]:
    return harvest_command(src, out, *sets("extract.batch_size=3", "engine.batches_per_actor=1"))


def test_shard_writes_absorb_a_flaky_store_and_fail_cleanly_when_it_vanishes(s3_chaos):
    import s3fs

    from pipeline.driver.failures import failure_message
    from pipeline.format.shards import ShardLayout, read_token_columns, write_shard
    from pipeline.format.storage import Store
    from tests_support import random_encoded

    proxy, direct = s3_chaos
    behind = s3fs.S3FileSystem(endpoint_url=direct)  # moto itself, never through the proxy
    behind.mkdir("hh-chaos-small")
    layout, rng = ShardLayout((1, 2, 3), 32), np.random.default_rng(0)

    def shard(k):
        return random_encoded(layout, f"s{k}", 3, 40, rng)

    store = Store("s3://hh-chaos-small/run")
    proxy.error_rate = 0.3
    try:
        names = [write_shard(store, shard(k), layout)[0] for k in range(4)]
    finally:
        proxy.error_rate = 0.0
    assert proxy.errors_served > 0  # retries absorbed these
    ids = [sid for t in read_token_columns("s3://hh-chaos-small/run") for sid in t["sample_id"].to_pylist()]
    assert sorted(ids) == sorted(f"s{k}-{i}" for k in range(4) for i in range(3))

    proxy.down()
    started = time.monotonic()
    try:
        with pytest.raises(Exception) as failed:
            write_shard(store, shard(9), layout)
    finally:
        proxy.up()
    assert time.monotonic() - started < 120, "retries must be bounded"
    message = failure_message(failed.value)
    # The root cause, named: botocore's EndpointConnectionError, or below it the refused connection itself.
    assert message.startswith(
        ("the run failed: EndpointConnectionError: ", "the run failed: ConnectionRefusedError: [Errno 111]")
    ), message
    assert "rerun the same command" in message
    assert not [secret for secret in SECRETS if secret in message]
    left = behind.find("hh-chaos-small/run", refresh=True)
    assert sorted(p.rsplit("/", 1)[1] for p in left) == sorted(n.rsplit("/", 1)[1] for n in names)  # nothing partial


@pytest.mark.long
def test_flaky_then_vanished_s3_fails_cleanly_and_a_rerun_completes(s3_chaos, e2e_input, tmp_path):
    """Each run is a CLI process with its own local Ray (as a user runs it); the proxy lives in this process."""
    import s3fs

    from pipeline.format.manifest import read_manifest
    from pipeline.format.shards import read_token_columns
    from pipeline.format.storage import Store
    from pipeline.tools.verify import verify

    proxy, direct = s3_chaos
    behind = s3fs.S3FileSystem(endpoint_url=direct)  # looks at moto itself, never through the proxy
    behind.mkdir("hh-chaos")
    lines = [line for line in e2e_input.read_text().splitlines() if line.strip()][:12]
    src = tmp_path / "in.jsonl"
    src.write_text("\n".join(lines) + "\n")
    out = "s3://hh-chaos/run"
    # Ray's logs of both runs land here, to be searched for credentials (short: Ray's socket paths are bounded).
    ray_tmp = Path(tempfile.mkdtemp(prefix="hhray"))
    env = dict(os.environ, RAY_ADDRESS="", RAY_TMPDIR=str(ray_tmp), AWS_ENDPOINT_URL=proxy.url)

    # Run 1: a fifth of all requests fail with 503 from the start; once a shard is committed, the endpoint vanishes.
    proxy.error_rate = 0.2
    vanished_at: list[float] = []

    def vanish_after_first_shard():
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline and not behind.glob("hh-chaos/run/shards/*.parquet", refresh=True):
            time.sleep(0.5)
        vanished_at.append(time.monotonic())
        proxy.down()

    watcher = threading.Thread(target=vanish_after_first_shard, daemon=True)
    watcher.start()
    try:
        first = subprocess.run(_harvest(src, out), cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    finally:
        watcher.join(timeout=5)
        proxy.up()
    ended_at = time.monotonic()
    assert first.returncode == 1, first.stdout[-2000:] + first.stderr[-3000:]
    err = first.stderr.strip().splitlines()[-1]  # above it: Ray's own log lines
    assert err.startswith("harvest: the run failed: EndpointConnectionError: Could not connect to the endpoint URL"), (
        err
    )
    assert "rerun the same command" in err
    assert proxy.errors_served > 0  # retries absorbed these: shards were committed while they happened
    assert vanished_at and ended_at - vanished_at[0] < 240, "retries must be bounded"
    committed = behind.glob("hh-chaos/run/shards/*.parquet", refresh=True)
    assert 1 <= len(committed) < 4
    assert not behind.glob("hh-chaos/run/shards/.tmp-*", refresh=True)

    # Run 2: the endpoint is back (still throwing some 503s): the rerun completes, each sample exactly once.
    proxy.error_rate = 0.1
    try:
        second = subprocess.run(_harvest(src, out), cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    finally:
        proxy.error_rate = 0.0
    assert second.returncode == 0, second.stdout[-2000:] + second.stderr[-3000:]
    assert "already committed" in second.stderr and "taking over the lock" in second.stderr
    totals = read_manifest(Store(out))["totals"]
    assert totals["accounted"] == totals["input_rows"] == len(lines)
    ids = [sid for t in read_token_columns(out) for sid in t["sample_id"].to_pylist()]
    assert len(ids) == len(set(ids)) == totals["samples_ok"] >= 8
    report = verify(out)
    assert report.ok, report.problems

    # No credential anywhere: printed or logged by the job, written to the output, or in Ray's logs of both runs.
    texts = [first.stdout, first.stderr, second.stdout, second.stderr]
    behind.invalidate_cache()
    texts += [behind.cat_file(p).decode(errors="replace") for p in behind.find("hh-chaos/run")]
    logs = [p for p in ray_tmp.rglob("*") if p.is_file() and "/logs/" in str(p) and p.stat().st_size < 50 * 2**20]
    texts += [p.read_text(errors="replace") for p in logs]
    assert len(logs) > 10
    for secret in SECRETS:
        assert os.environ["AWS_SECRET_ACCESS_KEY" if "secret" in secret else "AWS_ACCESS_KEY_ID"] == secret
        assert not [t[:200] for t in texts if secret in t], f"{secret} leaked"
    shutil.rmtree(ray_tmp, ignore_errors=True)

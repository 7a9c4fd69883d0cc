"""A flaky object store, then one that vanishes mid-run: retries absorb the errors, the vanished endpoint
ends the run with one clear line after bounded retries, and a rerun completes with every sample exactly
once. Credentials appear nowhere: not in what the job prints or logs, not in the output, not in Ray's logs.

The job writes to S3 (moto's real HTTP server) through tests/s3_chaos.py's proxy, which answers a share of
requests `503 SlowDown` and can close its port.
"""

from __future__ import annotations

import logging
import threading
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[2]
SECRETS = ("hh-test-secret", "hh-test-key")


def _wait_for_cpus_back(ray, timeout_s: float = 90.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if ray.available_resources().get("CPU", 0) >= ray.cluster_resources().get("CPU", 0):
            return
        time.sleep(1)
    raise AssertionError(f"the failed run's actors still hold CPUs: {ray.available_resources()}")


def test_flaky_then_vanished_s3_fails_cleanly_and_a_rerun_completes(ray_session, s3_chaos, e2e_input, tmp_path, capsys, caplog):
    import s3fs

    from pipeline.cli import main
    from pipeline.manifest import read_manifest
    from pipeline.shards import read_token_columns
    from pipeline.storage import Store
    from pipeline.verify import verify

    caplog.set_level(logging.INFO)
    proxy, direct = s3_chaos
    behind = s3fs.S3FileSystem(endpoint_url=direct)  # looks at moto itself, never through the proxy
    behind.mkdir("hh-chaos")
    lines = [line for line in e2e_input.read_text().splitlines() if line.strip()][:12]
    src = tmp_path / "in.jsonl"
    src.write_text("\n".join(lines) + "\n")
    out = "s3://hh-chaos/run"
    argv = ["run", str(REPO / "conf" / "default.yaml"), "--set", f"input.path={src}", "--set", f"output.path={out}",
            "--set", "extract.batch_size=3", "--set", "engine.max_in_flight=4", "--set", "engine.batches_per_actor=1"]  # fmt: skip

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
        rc = main(argv)
    finally:
        watcher.join(timeout=5)
        proxy.up()
    ended_at = time.monotonic()
    first = capsys.readouterr()
    assert rc == 1, first.err[-2000:]
    err = first.err.strip().splitlines()[-1]  # above it: Ray's own log lines
    assert err.startswith("harvest: the run failed: EndpointConnectionError: Could not connect to the endpoint URL"), err
    assert "rerun the same command" in err and "Traceback" not in err
    assert proxy.errors_served > 0  # retries absorbed these: shards were committed while they happened
    assert vanished_at and ended_at - vanished_at[0] < 240, "retries must be bounded"
    committed = behind.glob("hh-chaos/run/shards/*.parquet", refresh=True)
    assert 1 <= len(committed) < 4
    assert not behind.glob("hh-chaos/run/shards/.tmp-*", refresh=True)

    # The failed run's extractor actor (and the CPU it holds) is let go even though this process lives on.
    _wait_for_cpus_back(ray_session)

    # Run 2: the endpoint is back (still throwing some 503s): the rerun completes, each sample exactly once.
    proxy.error_rate = 0.1
    try:
        assert main(argv) == 0
    finally:
        proxy.error_rate = 0.0
    second = capsys.readouterr()
    totals = read_manifest(Store(out))["totals"]
    assert totals["accounted"] == totals["input_rows"] == len(lines)
    ids = [sid for t in read_token_columns(out) for sid in t["sample_id"].to_pylist()]
    assert len(ids) == len(set(ids)) == totals["samples_ok"] >= 8
    report = verify(out)
    assert report.ok, report.problems

    # No credential anywhere: printed, logged (driver), written to the output, or in this Ray session's logs.
    texts = [first.out, first.err, second.out, second.err, caplog.text]
    texts += [behind.cat_file(p).decode(errors="replace") for p in behind.find("hh-chaos/run")]
    session = Path(ray_session._private.worker._global_node.get_session_dir_path())
    texts += [p.read_text(errors="replace") for p in (session / "logs").rglob("*") if p.is_file() and p.stat().st_size < 50 * 2**20]
    assert len(texts) > 10
    for secret in SECRETS:
        assert not [t[:200] for t in texts if secret in t], f"{secret} leaked"

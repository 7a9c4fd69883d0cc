"""The cluster path: a Ray head on 127.0.0.1 (own ports, own temp dir), `ray job submit` of the default job.

Only the cluster this test started is stopped (its process group), never `ray stop`.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import requests

from pipeline.tools.verify import verify

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent


@pytest.fixture
def ray_head(tmp_path):
    from tests_support import free_ports

    gcs, dash, client, metrics, mgr, agent_http, agent_grpc = free_ports(7)
    env = dict(os.environ, RAY_AUTH_MODE="disabled", RAY_USAGE_STATS_ENABLED="0", PATH=f"{BIN}:{os.environ['PATH']}")
    temp = Path("/tmp") / f"hh-ray-{os.getpid()}"  # Ray's socket paths must stay short
    cmd = [
        str(BIN / "ray"),
        "start",
        "--head",
        "--block",
        "--node-ip-address=127.0.0.1",
        f"--port={gcs}",
        "--dashboard-host=127.0.0.1",
        f"--dashboard-port={dash}",
        f"--ray-client-server-port={client}",
        f"--metrics-export-port={metrics}",
        f"--node-manager-port={mgr}",
        f"--temp-dir={temp}",
        # The agent's default HTTP port (52365) may be held by another Ray on this machine (the test session's).
        f"--dashboard-agent-listen-port={agent_http}",
        f"--dashboard-agent-grpc-port={agent_grpc}",
        "--num-cpus=2",
        "--object-store-memory=300000000",
        "--include-dashboard=true",
    ]
    head = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    address = f"http://127.0.0.1:{dash}"
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            try:
                if requests.get(f"{address}/api/jobs/", timeout=2).ok:  # the job API, not just the web server
                    break
            except requests.RequestException:
                pass
            assert head.poll() is None, "ray start --head exited"
            time.sleep(1)
        else:
            pytest.fail("Ray head's dashboard did not come up")
        yield address, env
    finally:
        # The job has ended: nothing of this cluster is worth a graceful stop, which took ~30 s.
        for sig, wait in ((signal.SIGTERM, 5), (signal.SIGKILL, 10)):
            try:
                os.killpg(head.pid, sig)
                head.wait(timeout=wait)
                break
            except (ProcessLookupError, subprocess.TimeoutExpired):
                continue


def test_ray_job_submit_runs_the_default_job(ray_head, e2e_input, tmp_path):
    address, env = ray_head
    out = tmp_path / "out"
    cmd = [
        str(BIN / "ray"),
        "job",
        "submit",
        f"--address={address}",
        f"--working-dir={REPO}",
        "--",
        "harvest",
        "run",
        "conf/default.yaml",
        "--set",
        f"input.path={e2e_input}",
        "--set",
        f"output.path={out}",
        "--set",
        "extract.batch_size=8",
        "--set",
        "progress.interval_s=2",
    ]
    # The job API answers before the head's agent has registered; Ray then says to try again later.
    for _ in range(60):
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1200)
        log = proc.stdout + proc.stderr
        if "No available agent to submit job" not in log:
            break
        time.sleep(3)
    assert proc.returncode == 0, log[-4000:]
    assert "succeeded" in log
    assert "input rows" in log and "tok/s" in log and "written" in log  # the job's status lines reach job logs
    report = verify(str(out))
    assert report.ok, report.problems

"""pipeline/driver/priority.py: which of a local Ray's processes go to idle CPU priority (never the raylet, a
worker or anything under a worker, where the engines run), that the policy really lands on them, and when the
CLI asks for it (ray.idle_daemons)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

from conf.schema import load_config
from pipeline.driver import priority

RAY = "/venv/lib/python3.11/site-packages/ray"


def test_the_daemons_are_everything_under_the_driver_but_the_raylet_and_its_workers():
    table = {
        1: (0, "python -m pipeline.cli run conf/default.yaml"),
        2: (1, f"{RAY}/core/src/ray/gcs/gcs_server --log_dir=x"),
        3: (1, f"python -u {RAY}/dashboard/dashboard.py --host=127.0.0.1"),
        4: (3, "ray-dashboard-ReportHead-0 (/venv/bin/python -c from multiprocessing.spawn import spawn_main)"),
        5: (1, f"python -u {RAY}/_private/log_monitor.py --session-dir=x"),
        6: (1, f"{RAY}/core/src/ray/raylet/raylet --raylet_socket_name=x"),
        7: (6, f"python -u {RAY}/dashboard/agent.py --node-ip-address=x"),
        8: (6, f"python {RAY}/_private/workers/default_worker.py --node-ip-address=x"),  # before its title
        9: (6, "ray::MapWorker(MapBatches(HiddenStateExtractor))"),
        10: (9, "python -m sglang.launch_server --model-path m"),
        11: (10, "sglang::scheduler"),
        12: (8, "child of a worker"),
        13: (0, "someone else's process"),
    }
    assert priority.daemons(1, table) == [2, 3, 4, 5, 7]


def test_the_process_table_is_read_from_proc():
    table = priority._table()
    assert table[os.getpid()][0] == os.getppid()
    assert "pytest" in table[os.getpid()][1] or "python" in table[os.getpid()][1]


@pytest.mark.skipif(not hasattr(os, "SCHED_IDLE"), reason="Linux scheduling policies")
def test_the_driver_and_its_daemons_go_idle_and_the_workers_subtree_does_not():
    """In a process of its own (this one must keep its policy): a daemon-like child and a Ray-worker-titled
    child with a child of its own; after the scan the driver, the daemon and a thread the driver starts later
    are SCHED_IDLE, the worker and its child are not."""
    script = textwrap.dedent(
        """
        import json, os, subprocess, sys, threading, time
        from pipeline.driver.priority import IdleRayDaemons, _table
        daemon = subprocess.Popen(["sleep", "30"])
        worker = subprocess.Popen(["bash", "-c", "exec -a 'ray::IDLE' bash -c 'sleep 30 & wait'"])
        time.sleep(0.5)
        below = [pid for pid, (ppid, _) in _table().items() if ppid == worker.pid]
        with IdleRayDaemons(rescan_s=60) as idle:
            later = []
            t = threading.Thread(target=lambda: later.append(os.sched_getscheduler(threading.get_native_id())))
            t.start(); t.join()
            policy = lambda pid: os.sched_getscheduler(pid)
            print(json.dumps({"driver": policy(os.getpid()), "daemon": policy(daemon.pid), "worker": policy(worker.pid),
                              "below_worker": [policy(p) for p in below], "later_thread": later[0]}))
        for p in (daemon, worker):
            p.kill()
        """
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60, cwd=os.getcwd())
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout.strip().splitlines()[-1])
    idle, normal = os.SCHED_IDLE, os.SCHED_OTHER
    assert got["driver"] == idle and got["daemon"] == idle and got["later_thread"] == idle
    assert got["worker"] == normal and got["below_worker"] and set(got["below_worker"]) == {normal}


def test_the_cli_asks_for_it_only_for_a_local_ray_it_started(monkeypatch):
    import ray

    from pipeline import cli

    monkeypatch.delenv("RAY_ADDRESS", raising=False)

    def cfg(*sets):
        return load_config("conf/default.yaml", list(sets))

    gpus = {"GPU": 0}
    monkeypatch.setattr(ray, "cluster_resources", lambda: gpus)
    assert isinstance(cli._daemon_priority(cfg(), started_ray=True), priority.IdleRayDaemons)
    assert not isinstance(cli._daemon_priority(cfg(), started_ray=False), priority.IdleRayDaemons)
    assert not isinstance(cli._daemon_priority(cfg("ray.address=auto"), True), priority.IdleRayDaemons)
    assert not isinstance(cli._daemon_priority(cfg("ray.idle_daemons=off"), True), priority.IdleRayDaemons)
    gpus["GPU"] = 1  # the engine computes on the GPU: auto leaves Ray alone, on does not
    assert not isinstance(cli._daemon_priority(cfg(), True), priority.IdleRayDaemons)
    assert isinstance(cli._daemon_priority(cfg("ray.idle_daemons=on"), True), priority.IdleRayDaemons)
    monkeypatch.setenv("RAY_ADDRESS", "ray://head:10001")
    assert not isinstance(cli._daemon_priority(cfg("ray.idle_daemons=on"), True), priority.IdleRayDaemons)

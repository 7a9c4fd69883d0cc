import json
import socket
import subprocess
import sys
import time

import pytest

from pipeline.format.lock import LOCK, OutputLocked, RunLock, stale_reason
from pipeline.format.storage import Store


@pytest.fixture
def store(tmp_path):
    return Store(str(tmp_path / "out"))


def write_holder(store, **fields):
    holder = {
        "host": socket.gethostname(),
        "pid": 1,
        "run_id": "other",
        "started_at": time.time() - 60,
        "heartbeat_at": time.time(),
        "lease_s": 120.0,
    } | fields
    store.write_bytes(LOCK, json.dumps(holder).encode())
    return holder


def test_a_second_run_is_refused_with_the_holder_named_and_may_start_after_release(store):
    first = RunLock(store).acquire()
    with pytest.raises(
        OutputLocked, match=rf"in use by another run: pid \d+ on {socket.gethostname()} \(run {first.run_id}"
    ):
        RunLock(store).acquire()
    first.release()
    assert not store.exists(LOCK)
    with RunLock(store):
        assert store.exists(LOCK)
    assert not store.exists(LOCK)


def test_a_live_holder_on_another_host_is_respected(store):
    write_holder(store, host="elsewhere", pid=12345)
    with pytest.raises(OutputLocked, match="pid 12345 on elsewhere"):
        RunLock(store).acquire()


def test_an_expired_lease_is_taken_over_with_a_warning(store, caplog):
    write_holder(store, host="elsewhere", heartbeat_at=time.time() - 500)
    with RunLock(store) as lock:
        assert json.loads(store.read_bytes(LOCK))["run_id"] == lock.run_id
    assert "taking over the lock" in caplog.text and "lease expired" in caplog.text


def test_a_crashed_holder_on_this_host_is_taken_over(store):
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    holder = write_holder(store, pid=int(dead.stdout))
    assert stale_reason(holder) == f"its process {holder['pid']} on this host is gone"
    with RunLock(store) as lock:
        assert json.loads(store.read_bytes(LOCK))["run_id"] == lock.run_id


def test_a_lock_left_by_an_ended_run_of_this_process_is_stale(store):
    import os

    holder = write_holder(store, pid=os.getpid(), run_id="ended")
    assert stale_reason(holder) == "its run in this process has ended"


def test_the_heartbeat_refreshes_the_lease(store):
    with RunLock(store, heartbeat_s=0.05) as lock:
        first = json.loads(store.read_bytes(LOCK))["heartbeat_at"]
        time.sleep(0.3)
        holder = json.loads(store.read_bytes(LOCK))
        assert holder["heartbeat_at"] > first and holder["run_id"] == lock.run_id


def test_an_acquired_lock_used_as_a_context_manager_is_released_once(store):
    with RunLock(store).acquire():
        assert store.exists(LOCK)
    assert not store.exists(LOCK)

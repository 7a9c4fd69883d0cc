"""One run per output at a time: a lock object in the output (local or s3://) with its owner and a lease.

The lock names its holder (host, pid, run id, start time) and carries a heartbeat timestamp that a thread
of the holding run refreshes; a second run refuses while the lease is live. A crashed run cannot leave its
lock behind for ever: a lock whose lease has expired, or whose holder on this host is no longer running,
is taken over with a warning. Creation is exclusive on a local disk (O_EXCL); on object storage, which has
no exclusive create here, the writer reads its lock back and the one that reads another run's id refuses.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
import uuid

from pipeline.format.storage import Store

logger = logging.getLogger(__name__)

LOCK = "harvest.lock"
# A lease several heartbeats long: a run whose storage stalls for a while does not lose its lock.
LEASE_S = 120.0
HEARTBEAT_S = 15.0


# Run ids of the locks this process holds now: a lock naming this process but none of these was left by a
# run in this process that has ended (a failed run whose storage was gone when it tried to remove it).
_HELD: set[str] = set()


class OutputLocked(RuntimeError):
    """Another run holds the output; the message names it."""


def pid_alive(pid: int) -> bool:
    """Whether a process of this host runs under `pid` (another user's counts)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's live process
        return True
    return True


def describe(holder: dict) -> str:
    started = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(holder.get("started_at", 0)))
    return f"pid {holder.get('pid')} on {holder.get('host')} (run {holder.get('run_id')}, started {started})"


def stale_reason(holder: dict, now: float | None = None) -> str | None:
    """Why a lock no longer protects a live run, or None while it does."""
    now = time.time() if now is None else now
    age = now - float(holder.get("heartbeat_at", 0))
    if age > float(holder.get("lease_s", LEASE_S)):
        return f"its lease expired {age - float(holder.get('lease_s', LEASE_S)):.0f}s ago"
    if holder.get("host") == socket.gethostname():
        pid = int(holder.get("pid", -1))
        if not pid_alive(pid):
            return f"its process {pid} on this host is gone"
        if pid == os.getpid() and holder.get("run_id") not in _HELD:
            return "its run in this process has ended"
    return None


class RunLock:
    """acquire() ... release(); also a context manager. Refreshes its lease on a daemon thread while held."""

    def __init__(self, store: Store, lease_s: float = LEASE_S, heartbeat_s: float = HEARTBEAT_S):
        self.store = store
        self.lease_s = lease_s
        self.heartbeat_s = heartbeat_s
        self.run_id = uuid.uuid4().hex[:12]
        self.started_at = time.time()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _body(self) -> bytes:
        holder = {
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "run_id": self.run_id,
            "started_at": self.started_at,
            "heartbeat_at": time.time(),
            "lease_s": self.lease_s,
        }
        return (json.dumps(holder) + "\n").encode()

    def read(self) -> dict | None:
        try:
            return json.loads(self.store.read_bytes(LOCK))
        except FileNotFoundError:
            return None
        except ValueError:  # a lock cut short by a crash mid-write locally: nobody's
            return {}

    def _create(self) -> bool:
        """Exclusive create where the storage has it; False when a lock already exists."""
        if not self.store.local:
            if self.read() is not None:  # a read, not exists(): object-store listings may be cached
                return False
            self.store.write_bytes(LOCK, self._body())
            return True
        path = self.store.path(LOCK)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        except FileExistsError:
            return False
        with os.fdopen(fd, "wb") as f:
            f.write(self._body())
            f.flush()
            os.fsync(f.fileno())
        return True

    def acquire(self) -> RunLock:
        if self.run_id in _HELD:  # already held (e.g. acquired, then used as a context manager)
            return self
        if not self._create():
            holder = self.read()
            reason = stale_reason(holder) if holder else "it is unreadable"
            if reason is None:
                raise OutputLocked(
                    f"output {self.store.display()} is in use by another run: {describe(holder)}, last heartbeat "
                    f"{time.time() - float(holder.get('heartbeat_at', 0)):.0f}s ago. Wait for it to finish, or use "
                    f"another output.path. (A crashed run's lock is taken over once its lease of {holder.get('lease_s', LEASE_S):.0f}s expires.)"
                )
            logger.warning("taking over the lock of an earlier run, %s: %s", describe(holder or {}), reason)
            self.store.write_bytes(LOCK, self._body())
        # Two runs that wrote at the same instant on object storage: the last write wins, the other refuses.
        holder = self.read()
        if not holder or holder.get("run_id") != self.run_id:
            raise OutputLocked(f"output {self.store.display()} was just taken by another run: {describe(holder or {})}")
        _HELD.add(self.run_id)
        self._thread = threading.Thread(target=self._heartbeat, name="harvest-lock-heartbeat", daemon=True)
        self._thread.start()
        return self

    def _heartbeat(self) -> None:
        while not self._stop.wait(self.heartbeat_s):
            try:
                holder = self.read()
                if holder and holder.get("run_id") != self.run_id:
                    logger.error("the output lock was taken over by %s; this run no longer holds it", describe(holder))
                    return
                self.store.write_bytes(LOCK, self._body())
            except Exception as e:  # noqa: BLE001 -- a missed heartbeat is retried; the lease covers several
                logger.warning("could not refresh the output lock: %s: %s", type(e).__name__, e)

    def release(self) -> None:
        _HELD.discard(self.run_id)
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=30)
        try:
            holder = self.read()
            if holder is not None and holder.get("run_id") == self.run_id:
                self.store.remove(LOCK)
        except Exception as e:  # noqa: BLE001 -- a lock left behind is taken over by the next run (stale)
            logger.warning("could not remove the output lock: %s: %s", type(e).__name__, e)

    def __enter__(self) -> RunLock:
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()

"""Ray's own processes at idle CPU priority where the engine computes on this machine's cores.

Without a GPU the SGLang server runs one OpenMP compute thread per core and wants every core. Whatever else
runs takes a core from one of those threads, and the other waits for it at the next barrier, so a small
share of CPU elsewhere costs the server about twice its size. In the default job on two cores the server
took 174 % of them against 192 % for a plain server on the same prompts, while the driver and Ray's daemons
took ~9 % of one core, waking every few milliseconds (Ray Data's consumer polls every 10 ms)
(bench/results/cpu_share_cpu.json).

Under SCHED_IDLE a thread runs only on a core that no normal thread wants, and waking up it never preempts
one. `IdleRayDaemons` puts there, for as long as the job runs, this driver and the processes of the local
Ray it started that no engine descends from: gcs_server, the dashboard and its agents, the log monitor.
Not the raylet, nor any Ray worker: the actors, and the SGLang servers they start, are the raylet's
children, and a child inherits its parent's policy, which an unprivileged process cannot leave again.
Everything still runs, in the cores' idle moments; a Ray this process joined (a cluster) is left alone.
Linux only (elsewhere it does nothing).
"""

from __future__ import annotations

import logging
import os
import threading

logger = logging.getLogger(__name__)

RESCAN_S = 10.0  # daemons Ray starts later (the dashboard's module processes, agents) are picked up


def _table(proc: str = "/proc") -> dict[int, tuple[int, str]]:
    """pid -> (parent pid, command line) for every process readable under `proc`."""
    out = {}
    for entry in os.listdir(proc):
        if not entry.isdigit():
            continue
        try:
            with open(f"{proc}/{entry}/stat", "rb") as f:
                stat = f.read().decode(errors="replace")
            with open(f"{proc}/{entry}/cmdline", "rb") as f:
                cmd = f.read().replace(b"\0", b" ").decode(errors="replace").strip()
        except OSError:  # gone in the meantime, or not ours to read
            continue
        # Fields after the command name (which may hold spaces and parentheses): state, then the parent pid.
        ppid = int(stat.rpartition(")")[2].split()[1])
        out[int(entry)] = (ppid, cmd)
    return out


def _is_raylet(cmd: str) -> bool:
    return cmd.split(" ", 1)[0].endswith("/raylet") or cmd.split(" ", 1)[0] == "raylet"


def _is_worker(cmd: str) -> bool:
    # Ray's workers carry their task or actor in their process title; before that, default_worker.py.
    return cmd.startswith("ray::") or "default_worker.py" in cmd


def daemons(root: int, table: dict[int, tuple[int, str]]) -> list[int]:
    """The processes under `root` (its children, theirs, ...) that no engine descends from: every one except
    the raylet and Ray's workers, and nothing below a worker (an actor's SGLang server). The raylet's other
    children (the dashboard and runtime-env agents) are daemons."""
    children: dict[int, list[int]] = {}
    for pid, (ppid, _) in table.items():
        children.setdefault(ppid, []).append(pid)
    out, todo = [], list(children.get(root, []))
    while todo:
        pid = todo.pop()
        cmd = table[pid][1]
        if _is_worker(cmd):
            continue
        if not _is_raylet(cmd):
            out.append(pid)
        todo.extend(children.get(pid, []))
    return sorted(out)


def make_idle(pid: int) -> bool:
    """Every thread of `pid` under SCHED_IDLE (threads it starts later inherit it); False if it is gone."""
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return False
    for tid in tids:
        try:
            os.sched_setscheduler(int(tid), os.SCHED_IDLE, os.sched_param(0))
        except OSError:  # a thread that ended in the meantime
            pass
    return True


class IdleRayDaemons:
    """`with IdleRayDaemons():` this process and the Ray daemons under it at SCHED_IDLE, rescanned every
    RESCAN_S seconds while the block runs (a daemon started later is caught then). After the block this
    process's threads go back to the normal policy where it may (root, or RLIMIT_NICE allows it); otherwise
    they stay idle, which for the CLI process that ran the job costs nothing."""

    def __init__(self, rescan_s: float = RESCAN_S):
        self.rescan_s = rescan_s
        self.done: set[int] = set()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def scan(self) -> list[int]:
        """Puts the daemons not yet idle there; returns their pids."""
        me = os.getpid()
        new = [p for p in (me, *daemons(me, _table())) if p not in self.done]
        for pid in new:
            if make_idle(pid):
                self.done.add(pid)
        return new

    def __enter__(self) -> IdleRayDaemons:
        if not hasattr(os, "SCHED_IDLE") or not os.path.isdir("/proc"):
            logger.debug("no SCHED_IDLE here: Ray's daemons keep their priority")
            return self
        new = self.scan()
        logger.info(
            "driver and %d Ray daemon process(es) at idle CPU priority: the engine keeps the cores", len(new) - 1
        )
        self._thread = threading.Thread(target=self._run, name="idle-ray-daemons", daemon=True)
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.wait(self.rescan_s):
            try:
                self.scan()
            except OSError as e:  # /proc unreadable mid-scan: the next scan tries again
                logger.debug("idle priority rescan: %s", e)

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self._thread is None:
            return
        self._thread.join()
        for tid in os.listdir("/proc/self/task"):
            try:
                os.sched_setscheduler(int(tid), os.SCHED_OTHER, os.sched_param(0))
            except OSError:  # not permitted without privileges: this process stays idle
                break

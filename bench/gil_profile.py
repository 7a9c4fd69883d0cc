"""Which thread of a job's actor holds the interpreter lock while its forwards run: py-spy, summarised.

The hf engine's forward thread lets go of the GIL around every kernel launch and needs it back for the
next; any other thread of the actor that holds it then (Ray's, the extractor's calls, the encoders, the
finisher) delays the launch, and once the device has run what was queued, the forward with it. py-spy
reads the actor's memory from outside (`--nonblocking`: the actor is never paused) and, with `--gil`,
keeps only the samples of the thread holding the lock: per role, the share of wall time it held it, and
its hottest frames.

Used by bench/bench_job_gpu.py (--gil-profile PY_SPY): the actor is found by the engine's forward log
(actors/hf/engine.py, HIDDEN_HARVEST_FORWARD_LOG: one file per engine, named by its process id), and
sampling starts at its first forward after the warm-up.
"""

from __future__ import annotations

import collections
import json
import re
import subprocess
import threading
import time
from pathlib import Path

# (role, function, file): the first of these that a sample's stack holds decides its role. py-spy names a
# frame "Class.function (path:line)" (its qualified name), the path as the process loaded it.
ROLES = (
    ("forward", "_work_loop", "actors/hf/engine.py"),
    ("finisher", "_finish_loop", "actors/hf/engine.py"),
    ("encode", "_encode", "actors/extractor.py"),
    ("extractor_call", "__call__", "actors/extractor.py"),
)


def role(frames: list[str]) -> str:
    for name, function, file in ROLES:
        if any(f.split(" (", 1)[0].rsplit(".", 1)[-1] == function and file in f for f in frames):
            return name
    return "other"


def summarise(raw: str, rate: int, seconds: float) -> dict:
    """py-spy's raw (collapsed) output -> share of wall time each role held the GIL, and its top frames."""
    held: collections.Counter = collections.Counter()
    leaves: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    for line in raw.splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        frames = [f for f in stack.split(";") if not f.startswith(("thread (", "process "))]
        r = role(frames)
        held[r] += int(count)
        # The innermost frame of the project or of Ray/pyarrow/numpy: where the time goes.
        leaves[r][" <- ".join(frames[-1:-4:-1])[:300]] += int(count)
    total = rate * seconds
    return {
        "samples_possible": int(total),
        "samples_holding_gil": sum(held.values()),
        "share_of_wall_time": {k: round(v / total, 4) for k, v in held.most_common()},
        "top_frames": {k: [(f, n) for f, n in c.most_common(8)] for k, c in leaves.items()},
    }


class GilProfile:
    """py-spy on the actor of the first engine that logs a forward in `log_dir`, for `seconds`."""

    def __init__(self, py_spy: str, out: Path, log_dir: Path, seconds: float = 20.0, rate: int = 250):
        self.py_spy, self.out, self.log_dir, self.seconds, self.rate = py_spy, out, log_dir, seconds, rate
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._result: dict = {}

    def start(self) -> None:
        self._thread.start()

    def _actor(self, deadline: float) -> int | None:
        """The pid of the first engine whose log shows a forward after its warm-up."""
        while time.monotonic() < deadline:
            for path in self.log_dir.glob("forwards-*.jsonl"):
                lines = path.read_text().splitlines()
                if any(json.loads(x).get("reset") for x in lines) and not json.loads(lines[-1]).get("reset"):
                    return int(re.match(r"forwards-(\d+)-", path.name).group(1))
            time.sleep(0.05)
        return None

    def _run(self) -> None:
        pid = self._actor(time.monotonic() + 600)
        if pid is None:
            self._result = {"error": "no engine logged a forward"}
            return
        cmd = [self.py_spy, "record", "--pid", str(pid), "--gil", "--nonblocking", "--threads"]
        cmd += ["--rate", str(self.rate), "--duration", str(int(self.seconds)), "--format", "raw", "-o", str(self.out)]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0 or not self.out.is_file():
            self._result = {"error": f"py-spy exited {proc.returncode}: {(proc.stdout + proc.stderr)[-800:]}"}
            return
        self._result = {"pid": pid, "command": " ".join(cmd[1:])} | summarise(
            self.out.read_text(), self.rate, self.seconds
        )

    def result(self) -> dict:
        self._thread.join(timeout=self.seconds + 60)
        return self._result

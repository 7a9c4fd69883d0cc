"""Fault injection for the dump hook, for tests only: off unless HIDDEN_HARVEST_FAULTS is set.

HIDDEN_HARVEST_FAULTS="wrong_count:0.1,nan:0.1,..." gives each fault a probability per published dump (at
most one fault per dump). Every injection is appended to HIDDEN_HARVEST_FAULT_LOG as a JSON line
{"fault": ..., "rid": ...}, so a test can prove each one was caught: caught / injected.
  wrong_count  the dump holds one token fewer than the request (header, shapes and body agree)
  wrong_rid    two requests of one forward swap dumps (file name and header both name the other request)
  truncated    the body is cut in half
  nan          the device counted a non-finite value
  missing      no dump at all
  late         the dump appears LATE_S seconds after the answer (after the client stopped waiting)
  kill         the whole server is killed (once per dump directory)
"""

from __future__ import annotations

import json
import os
import random
import signal
import threading

KINDS = ("wrong_count", "wrong_rid", "truncated", "nan", "missing", "late", "kill")
LATE_S = float(os.environ.get("HIDDEN_HARVEST_FAULT_LATE_S", "5"))


class Faults:
    def __init__(self, spec: str, log_path: str | None, dump_dir: str):
        self.rates = {}
        for item in filter(None, (p.strip() for p in spec.split(","))):
            kind, _, rate = item.partition(":")
            if kind not in KINDS:
                raise ValueError(f"HIDDEN_HARVEST_FAULTS: unknown fault {kind!r}; known: {KINDS}")
            self.rates[kind] = float(rate or 1.0)
        self.log_path = log_path
        self.late_s = LATE_S
        self.kill_marker = os.path.join(dump_dir, ".fault-killed")
        self._rng = random.Random(int(os.environ.get("HIDDEN_HARVEST_FAULT_SEED", "0")))
        self._lock = threading.Lock()

    @classmethod
    def from_env(cls, dump_dir: str) -> Faults | None:
        spec = os.environ.get("HIDDEN_HARVEST_FAULTS")
        return cls(spec, os.environ.get("HIDDEN_HARVEST_FAULT_LOG"), dump_dir) if spec else None

    def roll(self, kind: str) -> bool:
        with self._lock:
            return self._rng.random() < self.rates.get(kind, 0.0)

    def pick(self) -> str | None:
        """One of the per-dump faults (not wrong_rid, which needs two requests), or None."""
        for kind in KINDS:
            if kind != "wrong_rid" and self.roll(kind):
                if kind == "kill" and os.path.exists(self.kill_marker):
                    continue
                return kind
        return None

    def record(self, kind: str, rid: str) -> None:
        if self.log_path:
            with self._lock, open(self.log_path, "a") as f:
                f.write(json.dumps({"fault": kind, "rid": rid}) + "\n")

    def kill_server(self) -> None:
        open(self.kill_marker, "w").close()
        os.killpg(os.getpgid(0), signal.SIGKILL)

    def apply(self, header: dict, body: list, aux_width: int, hidden: int, write) -> bool:
        """At most one fault on a dump about to be published (body: its parts, edited in place).

        False: publish nothing now (`write(header, body)` may still run later, for `late`)."""
        kind = self.pick()
        if kind is None:
            return True
        rid, n = header["rid"], header["num_tokens"]
        self.record(kind, rid)
        if kind == "wrong_count" and n > 0:
            header.update(num_tokens=n - 1, aux_shape=[n - 1, aux_width], last_shape=[n - 1, hidden])
            per_token = (
                2 * (aux_width + hidden)
                if header.get("layout", "planes") == "planes"
                else 4 * (aux_width // hidden) + aux_width + 4 + hidden
            )
            body[:] = [b"".join(bytes(b) for b in body)[: per_token * (n - 1)]]
        elif kind == "truncated":
            data = b"".join(bytes(b) for b in body)
            body[:] = [data[: len(data) // 2]]
        elif kind == "nan":
            header["nonfinite"] += 1
        elif kind == "missing":
            return False
        elif kind == "late":
            data = [b"".join(bytes(b) for b in body)]  # the host buffer is reused before the timer fires
            timer = threading.Timer(self.late_s, write, (dict(header), data))
            timer.daemon = True  # a late dump never holds up the server's exit
            timer.start()
            return False
        elif kind == "kill":
            self.kill_server()
        return True

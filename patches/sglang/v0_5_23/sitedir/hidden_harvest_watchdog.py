"""Ends an SGLang server whose starter has died (a Ray actor killed by force never runs its teardown).

Runs as a daemon thread in the server's main process, which leads its own process group (the engine
starts it in a new session); SGLang's scheduler and detokenizer are in that group. When the parent pid
changes (the starter died and the server was re-parented), the group gets SIGTERM, then SIGKILL, and the
private dump directory is removed. Independent of the SGLang version: it touches no SGLang code.
"""

from __future__ import annotations

import os
import shutil
import signal
import threading
import time

POLL_S = 1.0
GRACE_S = 10.0


def _watch(parent: int) -> None:
    while os.getppid() == parent:
        time.sleep(POLL_S)
    dump_dir = os.environ.get("HIDDEN_HARVEST_DUMP_DIR")
    if dump_dir:
        shutil.rmtree(dump_dir, ignore_errors=True)
    os.killpg(0, signal.SIGTERM)
    time.sleep(GRACE_S)
    os.killpg(0, signal.SIGKILL)


def start(parent: int) -> None:
    if os.getppid() != parent:  # already orphaned before start-up finished
        os.killpg(0, signal.SIGKILL)
    threading.Thread(target=_watch, args=(parent,), name="hidden-harvest-watchdog", daemon=True).start()

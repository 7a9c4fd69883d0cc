"""Ray's noise that a user of this job cannot act on, quieted where it starts.

Ray Data creates every actor of an actor pool with its operator's code and context as object-store
arguments, and with restarts allowed. Ray's core worker then logs, once per process, an error line that
such an actor's restart fails if those arguments are gone (ray-project/ray#53727). Ray Data holds them for
as long as the dataset runs, so in this job the line never means anything, and a first run that begins with
an error a user cannot act on does not read cleanly. `spend_actor_restart_notice` spends that one line on a
throwaway actor created with the process's stderr pointed at /dev/null for the duration of the call; every
other error line, and this one for any later process, is untouched.
"""

from __future__ import annotations

import logging
import os
import sys
import threading

logger = logging.getLogger(__name__)

_spent = False


def spend_actor_restart_notice() -> None:
    """Create (and kill) one actor that draws Ray's once-per-process restart notice, with it going nowhere."""
    global _spent
    if _spent:
        return
    _spent = True
    import ray

    @ray.remote(num_cpus=0, max_restarts=1)
    class _Throwaway:
        def __init__(self, _arg):
            pass

        def ready(self) -> bool:
            return True

    arg = ray.put(None)  # passed by reference: the condition of the notice
    sys.stderr.flush()
    saved, devnull = os.dup(2), os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, 2)
        actor = _Throwaway.remote(arg)  # the core worker logs the notice here, synchronously
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(devnull)
    # Ended once it is up: ending an actor whose creation is still under way makes the GCS log an error
    # of its own. Waited for on a thread: its process starts beside the job's work, never before it.
    threading.Thread(target=_end_when_up, args=(actor,), name="spent-notice-actor", daemon=True).start()


def _end_when_up(actor) -> None:
    import ray

    try:
        ray.get(actor.ready.remote(), timeout=120)
    except Exception as e:  # noqa: BLE001 - a cluster too busy to place it: it is ended all the same
        logger.debug("throwaway actor not up: %s", e)
    ray.kill(actor)

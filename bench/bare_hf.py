"""The benchmarks' baseline: the hf engine with nothing kept.

The same batching, forwards, worker and finisher threads and the same device clock as the capturing
engine (actors/hf/engine.py), without the capture: no hooks keep outputs, nothing is staged or copied, and
each request resolves with no capture once its forward has run. What a job costs beyond this is what
capturing, validating, encoding and committing cost.
"""

from __future__ import annotations

import time

from actors.engine import RequestResult
from actors.hf.engine import HFEngine, _Staged


class BareHFEngine(HFEngine):
    _keeps = False

    def _stage(self, batch, ids) -> _Staged:
        if self.cuda:
            self._mark("end")()  # the finisher waits on it: results resolve once the forward has run
        return _Staged(batch, ids)

    def _resolve(self, staged: _Staged) -> None:
        now = time.monotonic()
        self.last_done_unix = time.time()
        for r in staged.batch:
            r.future.set_result(RequestResult(r.key, None, None, now - r.submitted))

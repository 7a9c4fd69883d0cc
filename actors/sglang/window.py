"""How full an engine kept its in-flight window: reported in the manifest's engine stats."""

from __future__ import annotations

import time


class WindowClock:
    """How full the capture window was, from the engine's start (after warm-up) to now: the seconds with
    nothing in flight, with the window short of full, and the mean number in flight. A job slower than a
    plain server at the same window shows here whether the server was kept fed. Touched only from the
    engine's event loop; read from any thread (a snapshot of a few floats)."""

    def __init__(self, size: int):
        self.size = size
        self.reset()

    def reset(self, now: float | None = None) -> None:
        self.since = self._last = time.monotonic() if now is None else now
        self.in_flight = self.requests = 0
        self.idle_s = self.short_s = self.area = 0.0

    def change(self, delta: int, now: float) -> None:
        span = now - self._last
        self.idle_s += span * (self.in_flight == 0)
        self.short_s += span * (self.in_flight < self.size)
        self.area += span * self.in_flight
        self._last, self.in_flight = now, self.in_flight + delta
        self.requests += delta > 0

    def snapshot(self) -> dict:
        now = time.monotonic()
        span = max(now - self.since, 1e-9)
        tail = now - self._last  # the stretch since the last change, at the current level
        return {
            "size": self.size,
            "requests": self.requests,
            "seconds": round(span, 3),
            "idle_s": round(self.idle_s + tail * (self.in_flight == 0), 3),
            "short_of_full_s": round(self.short_s + tail * (self.in_flight < self.size), 3),
            "mean_in_flight": round((self.area + tail * self.in_flight) / span, 2),
        }

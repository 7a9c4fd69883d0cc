"""The GPU's SM clock and power draw over a benchmark, sampled by nvidia-smi, read back per time window.

A job's forwards can take more device time per token than the bare engine's for two kinds of reasons: the
device waits inside them (on the host: bench/gil_profile.py and the engine's layer excess say how much), or
every kernel runs slower (a lower clock under a power limit, with the capture's copies and staging beside
the forwards). This tells the second apart: the median clock and power while the bare engine's passes run
and while the job's forwards run.
"""

from __future__ import annotations

import logging
import shutil
import statistics
import subprocess
import time
from pathlib import Path

logger = logging.getLogger(__name__)


class GpuClock:
    """nvidia-smi in the background every `period_ms`, one CSV line per sample with the wall clock."""

    def __init__(self, out: Path, period_ms: int = 100):
        self.out, self.period_ms = out, period_ms
        self._proc: subprocess.Popen | None = None
        self._file = None

    def start(self) -> GpuClock:
        if shutil.which("nvidia-smi") is None:
            logger.warning("no nvidia-smi: no clock samples")
            return self
        self._file = self.out.open("w")
        query = "timestamp,clocks.sm,power.draw,utilization.gpu,temperature.gpu"
        self._proc = subprocess.Popen(
            ["nvidia-smi", f"--query-gpu={query}", "--format=csv,noheader,nounits", f"-lms={self.period_ms}"],
            stdout=self._file,
            stderr=subprocess.DEVNULL,
        )
        return self

    def stop(self) -> None:
        if self._proc is not None:
            self._proc.terminate()
            self._proc.wait(timeout=10)
            self._proc = None
        if self._file is not None:
            self._file.close()
            self._file = None

    def _samples(self) -> list[tuple[float, float, float, float, float]]:
        rows = []
        if not self.out.is_file():
            return rows
        for line in self.out.read_text().splitlines():
            parts = [p.strip() for p in line.split(",")]
            if len(parts) != 5:
                continue
            try:
                # nvidia-smi's timestamp is local time, "YYYY/MM/DD HH:MM:SS.mmm"
                t = time.mktime(time.strptime(parts[0].split(".")[0], "%Y/%m/%d %H:%M:%S"))
                t += float("0." + parts[0].split(".")[1]) if "." in parts[0] else 0.0
                rows.append((t, *(float(x) for x in parts[1:])))
            except ValueError:
                continue
        return rows

    def window(self, start_unix: float, end_unix: float) -> dict:
        """Median SM clock (MHz), power (W), utilisation (%) and temperature (C) between two wall clocks."""
        inside = [r for r in self._samples() if start_unix <= r[0] <= end_unix]
        if not inside:
            return {}
        return {
            "samples": len(inside),
            "sm_clock_mhz_median": statistics.median(r[1] for r in inside),
            "power_w_median": statistics.median(r[2] for r in inside),
            "utilization_pct_median": statistics.median(r[3] for r in inside),
            "temperature_c_max": max(r[4] for r in inside),
        }

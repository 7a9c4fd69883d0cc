"""Small helpers shared by tests (importable because pytest puts tests/ on sys.path via conftest)."""

from __future__ import annotations

import socket
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]


def free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def harvest_command(input_path, out, *extra: str) -> list[str]:
    """`harvest run` of the default config as a CLI process of its own (its own local Ray on 2 CPUs), small batches."""
    return [
        sys.executable, "-m", "pipeline.cli", "run", str(REPO_ROOT / "conf" / "default.yaml"),
        "--set", f"input.path={input_path}", "--set", f"output.path={out}", "--set", "engine.max_in_flight=4",
        "--set", "progress.interval_s=2", "--set", "ray.num_cpus=2", "--set", "ray.object_store_memory_mb=300", *extra,
    ]  # fmt: skip

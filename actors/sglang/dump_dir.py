"""Where an SGLang server publishes its dumps: a private directory per engine, in memory where the host has
/dev/shm, and the directories of processes that are gone removed on the next start."""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
from pathlib import Path

from pipeline.format.lock import pid_alive

logger = logging.getLogger(__name__)

DUMP_DIR_PREFIX = "hidden-harvest-"


def default_dump_root() -> Path:
    # /dev/shm keeps dumps in memory: they live for milliseconds between the hook and the reader.
    shm = Path("/dev/shm")
    return shm if shm.is_dir() else Path(tempfile.gettempdir())


def make_dump_dir(root: Path) -> Path:
    """A private (0700, unique) dump directory named after this process, so a later start can tell it is orphaned."""
    return Path(tempfile.mkdtemp(prefix=f"{DUMP_DIR_PREFIX}{os.getpid()}-", dir=root))


def remove_orphaned_dump_dirs(root: Path) -> list[Path]:
    """Dump directories whose process is gone (killed with its server, or a host crash that kept /dev/shm).

    The server's watchdog removes its directory when only the starter dies; this covers the rest. Only
    this user's directories with the current naming (`hidden-harvest-<pid>-`) are considered.
    """
    removed = []
    for d in root.glob(f"{DUMP_DIR_PREFIX}*-*"):
        pid = d.name[len(DUMP_DIR_PREFIX) :].split("-", 1)[0]
        try:
            if not pid.isdigit() or not d.is_dir() or d.stat().st_uid != os.getuid() or pid_alive(int(pid)):
                continue
        except OSError:  # gone meanwhile
            continue
        shutil.rmtree(d, ignore_errors=True)
        removed.append(d)
    if removed:
        logger.info("removed %d dump directories left by processes that are gone", len(removed))
    return removed

"""The dump directory: private to the run (0700, unique), removed on close, and an orphan removed on the next start."""

import os
import stat
import subprocess
import sys

from actors.sglang.dump_dir import make_dump_dir, remove_orphaned_dump_dirs
from actors.sglang.engine import SGLangEngine


def test_each_engine_gets_a_private_unique_dump_dir_removed_on_close(tmp_path, monkeypatch):
    monkeypatch.setattr("actors.sglang.engine.default_dump_root", lambda: tmp_path)
    spec = {"model_dir": tmp_path, "aux_layers": (1,), "cpu": True}
    a, b = SGLangEngine(spec, 1, 10), SGLangEngine(spec, 1, 10)  # not started: no server needed
    assert a.spec.dump_dir != b.spec.dump_dir
    for e in (a, b):
        assert stat.S_IMODE(e.spec.dump_dir.stat().st_mode) == 0o700
        assert e.spec.dump_dir.name.startswith(f"hidden-harvest-{os.getpid()}-")
    a.close()
    b.close()
    assert list(tmp_path.iterdir()) == []


def test_dump_dirs_of_processes_that_are_gone_are_removed_on_the_next_start(tmp_path):
    dead = int(
        subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True).stdout
    )
    orphan = tmp_path / f"hidden-harvest-{dead}-abc123"
    orphan.mkdir()
    (orphan / "hh-x.hhd").write_bytes(b"states")
    live = make_dump_dir(tmp_path)
    other = tmp_path / "hidden-harvest-legacyname"  # not this naming: never touched
    other.mkdir()
    assert remove_orphaned_dump_dirs(tmp_path) == [orphan]
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([live.name, other.name])

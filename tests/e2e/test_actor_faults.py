"""One real job (CLI, its own local Ray) that meets an actor killed mid-run and captures that fail, then one
`--retry-errors` rerun. While it runs: a second run into the same output is refused naming the holder, and
the SGLang server listens on 127.0.0.1 only with a private dump directory.

- kill -9 of the extractor actor: Ray restarts it and retries its batch; the run still exits 0 with every
  input row accounted for once (the server of the killed actor is ended by its watchdog).
- captures that fail every attempt (the hook drops dumps, extract.retries=0) end as `extract` error rows;
  `harvest run --retry-errors` runs exactly those again, never parse/tokenize errors, and the totals stay exact.
"""

from __future__ import annotations

import collections
import json
import os
import signal
import stat
import subprocess
import time
from pathlib import Path

import pytest

from tests_support import harvest_command, processes_matching

# Three SGLang server starts and two local Ray clusters: ~4-6 minutes on the 2-core machine. In the suite,
# the same properties in small: the loopback-only server and private dump directory (test_engine.py), the
# refusal of a second run (unit/pipeline/format/test_lock.py), which rows --retry-errors reopens
# (unit/pipeline/format/test_retry_errors.py), the server ended with the process that started it (test_engine.py).
pytestmark = [pytest.mark.slow, pytest.mark.long]
REPO = Path(__file__).resolve().parents[2]


def _harvest(input_path, out, *extra) -> list[str]:
    return harvest_command(
        input_path, out, "--set", "extract.batch_size=3", "--set", "engine.batches_per_actor=1", *extra
    )


def _descendants(pid: int, needle: str):
    return processes_matching(needle, under=pid)


def _error_rows(out: Path) -> list[dict]:
    return [
        json.loads(line)
        for f in (out / "errors").glob("part-*.jsonl")
        for line in f.read_text().splitlines()
        if line.strip()
    ]


def test_actor_killed_and_failed_captures_then_retry_errors(ray_session, e2e_input, tmp_path, capsys):
    import psutil

    from pipeline.cli import main
    from pipeline.format.manifest import read_manifest
    from pipeline.format.shards import read_token_columns
    from pipeline.format.storage import Store
    from pipeline.tools.verify import verify

    out = tmp_path / "out"
    env = dict(os.environ, RAY_ADDRESS="", HIDDEN_HARVEST_FAULTS="missing:0.3")
    args = ["--set", "extract.retries=0", "--set", "engine.dump_timeout_s=1"]
    proc = subprocess.Popen(
        _harvest(e2e_input, out, *args), cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT
    )
    checked_server = refused = killed = False
    dump_dir = None
    deadline = time.monotonic() + 900
    try:
        while time.monotonic() < deadline and proc.poll() is None and not (checked_server and refused and killed):
            time.sleep(0.5)
            if not checked_server:
                for server in _descendants(proc.pid, "sglang.launch_server"):
                    group = [server] + server.children(recursive=True)
                    listening = [
                        c.laddr for p in group for c in p.net_connections(kind="inet") if c.status == psutil.CONN_LISTEN
                    ]
                    if not listening:
                        continue
                    assert {a.ip for a in listening} <= {"127.0.0.1", "::1"}, listening
                    dump_dir = Path(server.environ()["HIDDEN_HARVEST_DUMP_DIR"])
                    assert stat.S_IMODE(dump_dir.stat().st_mode) == 0o700 and dump_dir.name.startswith(
                        "hidden-harvest-"
                    )
                    checked_server = True
            if not list((out / "shards").glob("part-*.parquet")):
                continue
            if not refused:
                # A second run into the same output while the first holds it.
                rc = main(_harvest(e2e_input, out)[3:])
                err = capsys.readouterr().err
                assert rc == 2 and f"is in use by another run: pid {proc.pid} on " in err, err
                refused = True
            if not killed:
                (actor,) = _descendants(proc.pid, "HiddenStateExtractor")
                actor.send_signal(signal.SIGKILL)
                killed = True
        log = proc.communicate(timeout=max(1, deadline - time.monotonic()))[0].decode()
    finally:
        if proc.poll() is None:
            proc.kill()
    assert checked_server and refused and killed, log[-3000:]
    assert proc.returncode == 0, log[-3000:]

    rows = [line for line in e2e_input.read_text().splitlines() if line.strip()]
    totals = read_manifest(Store(str(out)))["totals"]
    assert totals["accounted"] == totals["input_rows"] == len(rows)
    first_errors = _error_rows(out)
    by_stage = collections.Counter(e["stage"] for e in first_errors)
    assert by_stage["extract"] >= 1 and all(
        "no hidden-state dump" in e["reason"] for e in first_errors if e["stage"] == "extract"
    )
    ids = [sid for t in read_token_columns(str(out)) for sid in t["sample_id"].to_pylist()]
    assert len(ids) == len(set(ids)) == totals["samples_ok"]
    assert not set(ids) & {e["sample_id"] for e in first_errors}
    for _ in range(60):  # the killed actor's server was ended by its watchdog, which removed the dump directory
        if not dump_dir.exists():
            break
        time.sleep(0.5)
    assert not dump_dir.exists()

    # --retry-errors, no faults now: exactly the extract errors run again; parse/tokenize errors stay.
    rerun = subprocess.run(
        _harvest(e2e_input, out, "--retry-errors"),
        cwd=REPO,
        env=dict(os.environ, RAY_ADDRESS=""),
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert rerun.returncode == 0, rerun.stdout[-2000:] + rerun.stderr[-3000:]
    assert f"{by_stage['extract']} samples with a transient (engine/extract) error will run again" in rerun.stderr
    after = read_manifest(Store(str(out)))["totals"]
    assert after["samples_ok"] == totals["samples_ok"] + by_stage["extract"]
    assert after["errors"] == totals["errors"] - by_stage["extract"]
    assert after["accounted"] == after["input_rows"] == len(rows)
    assert collections.Counter(e["stage"] for e in _error_rows(out)) == collections.Counter(
        {k: v for k, v in by_stage.items() if k != "extract"}
    )
    ids = [sid for t in read_token_columns(str(out)) for sid in t["sample_id"].to_pylist()]
    assert len(ids) == len(set(ids)) == after["samples_ok"]
    report = verify(str(out))
    assert report.ok, report.problems

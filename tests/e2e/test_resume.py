"""Exactly-once resume: SIGKILL the driver mid-run, rerun, and every input row is accounted for once."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from pipeline.format.manifest import SettingsMismatch, read_manifest
from pipeline.format.shards import open_shards
from pipeline.format.storage import Store
from pipeline.tools.verify import verify
from tests_support import harvest_command

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[2]


def _harvest(input_path, out, *sets) -> list[str]:
    return harvest_command(input_path, out, "--set", "extract.batch_size=4", *sets)


def test_sigkill_then_rerun_is_exactly_once(e2e_input, tmp_path):
    out = tmp_path / "out"
    env = dict(os.environ, RAY_ADDRESS="")  # its own local Ray, separate from the test session's
    proc = subprocess.Popen(
        _harvest(e2e_input, out), cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT
    )
    deadline = time.monotonic() + 400
    while time.monotonic() < deadline and proc.poll() is None:
        if len(list((out / "shards").glob("part-*.parquet"))) >= 2:
            break
        time.sleep(0.5)
    assert proc.poll() is None, "the job finished before it could be killed:\n" + proc.stdout.read().decode()[-3000:]
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    committed_before = len(list((out / "shards").glob("part-*.parquet")))
    assert committed_before >= 2
    assert read_manifest(Store(str(out)))["status"] == "running"

    rerun = subprocess.run(_harvest(e2e_input, out), cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    assert rerun.returncode == 0, rerun.stdout[-3000:] + rerun.stderr[-3000:]
    assert "already committed" in rerun.stderr

    rows = [json.loads(line) for line in e2e_input.read_text().splitlines() if line.strip()]
    totals = read_manifest(Store(str(out)))["totals"]
    assert totals["accounted"] == totals["input_rows"] == len(rows)
    assert f"= {len(rows)} of {len(rows)} input rows" in rerun.stdout
    ids = [s["sample_id"] for s in open_shards(str(out), as_torch=False)]
    assert len(ids) == len(set(ids)) == totals["samples_ok"]
    assert not [p for p in (out / "shards").iterdir() if p.name.startswith(".tmp-")]
    report = verify(str(out))
    assert report.ok, report.problems


def test_a_rerun_with_different_data_settings_is_refused(harvest_run, e2e_input, make_config):
    from pipeline.driver.job import run

    out, _ = harvest_run
    before = sorted(p.name for p in (out / "shards").iterdir())
    with pytest.raises(SettingsMismatch) as err:
        run(make_config(e2e_input, out, **{"extract.max_tokens": 1024, "extract.aux_layers": "[1, 2, 3]"}))
    assert "max_tokens" in str(err.value) and "aux_layers" in str(err.value)
    assert sorted(p.name for p in (out / "shards").iterdir()) == before


def test_a_rerun_with_the_same_settings_adds_nothing(harvest_run, e2e_input, make_config):
    from pipeline.driver.job import run

    out, first = harvest_run
    summary = run(make_config(e2e_input, out))
    assert summary.this_run.done == 0
    assert summary.totals == first.totals

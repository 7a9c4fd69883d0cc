"""`harvest verify` on a real output, then on copies corrupted on purpose."""

from __future__ import annotations

import shutil
import subprocess
import sys

import pytest

from pipeline.tools.verify import verify

pytestmark = pytest.mark.slow


def _harvest_verify(path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pipeline.cli", "verify", str(path)], capture_output=True, text=True)


def test_a_real_output_verifies_and_the_cli_says_so(copy):
    report = verify(str(copy))
    assert report.ok, report.problems
    assert report.samples >= 16 and report.tokens > 0 and report.bytes > 0
    proc = _harvest_verify(copy)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "OK" in proc.stdout


def test_truncated_shard_fails(copy):
    shard = sorted((copy / "shards").glob("*.parquet"))[0]
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    report = verify(str(copy))
    assert not report.ok
    assert any(shard.name in p and "cannot be read" in p for p in report.problems), report.problems
    proc = _harvest_verify(copy)
    assert proc.returncode == 1 and "cannot be read" in proc.stdout


def test_duplicated_shard_fails(copy):
    shard = sorted((copy / "shards").glob("*.parquet"))[0]
    shutil.copy(shard, copy / "shards" / "part-0000000000copy.parquet")
    problems = verify(str(copy)).problems
    assert any("more than one shard" in p for p in problems), problems
    assert any("name does not match" in p for p in problems), problems


def test_deleted_shard_fails(copy):
    sorted((copy / "shards").glob("*.parquet"))[0].unlink()
    problems = verify(str(copy)).problems
    assert any("totals.samples_ok" in p for p in problems), problems


def test_missing_manifest_fails(copy):
    (copy / "manifest.json").unlink()
    assert verify(str(copy)).problems == ["no manifest.json"]

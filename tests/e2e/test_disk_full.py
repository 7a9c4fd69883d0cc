"""The output's disk fills up mid-run: a real ENOSPC from the filesystem, no partial shard committed, one
clear line, and a rerun after space is freed completes with every sample exactly once.

The output lives on a small tmpfs mounted in a user + mount namespace (`unshare`, no root needed where
unprivileged user namespaces are allowed); another process fills it once the first shard is committed.
Skipped, saying why, where the kernel does not allow that.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pyarrow.parquet as pq
import pytest

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[2]

SCRIPT = r"""
set -u
mount -t tmpfs -o size=64m tmpfs "$DISK" || exit 90
OUT="$DISK/out"
run() { "$PY" -m pipeline.cli run "$CONF" --set "input.path=$INPUT" --set "output.path=$OUT" --set extract.batch_size=3 \
          --set engine.max_in_flight=4 --set engine.batches_per_actor=1 --set ray.num_cpus=2 --set ray.object_store_memory_mb=300; }
run > "$SAVE/run1.log" 2>&1 &
job=$!
while [ -z "$(ls "$OUT"/shards/*.parquet 2>/dev/null)" ] && kill -0 $job 2>/dev/null; do sleep 0.2; done
dd if=/dev/zero of="$DISK/filler" bs=64k 2>/dev/null   # another process takes every free byte
df -k "$DISK" > "$SAVE/df_full.txt"
wait $job; echo $? > "$SAVE/rc1"
cp -a "$OUT" "$SAVE/after_failure"
rm -f "$DISK/filler"                                     # space is freed
run > "$SAVE/run2.log" 2>&1; echo $? > "$SAVE/rc2"
cp -a "$OUT" "$SAVE/after_rerun"
"""


def _namespaces_work() -> bool:
    if not shutil.which("unshare"):
        return False
    probe = subprocess.run(["unshare", "--user", "--map-root-user", "--mount", "true"], capture_output=True)
    return probe.returncode == 0


@pytest.mark.skipif(
    not _namespaces_work(), reason="needs unprivileged user + mount namespaces (unshare) for a real tmpfs"
)
def test_disk_full_during_a_shard_write_then_rerun_after_freeing_space(e2e_input, tmp_path):
    from pipeline.format.shards import shard_name
    from pipeline.tools.verify import verify

    disk, save = tmp_path / "disk", tmp_path / "save"
    disk.mkdir()
    save.mkdir()
    env = dict(
        os.environ,
        RAY_ADDRESS="",
        DISK=str(disk),
        SAVE=str(save),
        PY=sys.executable,
        INPUT=str(e2e_input),
        CONF=str(REPO / "conf" / "default.yaml"),
    )
    proc = subprocess.run(
        ["unshare", "--user", "--map-root-user", "--mount", "bash", "-c", SCRIPT],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=1500,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    run1 = (save / "run1.log").read_text()
    assert (save / "rc1").read_text().strip() == "1", run1[-3000:]
    assert (save / "df_full.txt").read_text().splitlines()[1].split()[3] == "0"  # the disk was full
    last = run1.strip().splitlines()[-1]
    assert last.startswith("harvest: the run failed: OSError: [Errno 28] ") and "No space left on device" in last, run1[
        -3000:
    ]
    assert "free space and rerun the same command" in last

    # Nothing partial became visible: every committed shard is whole and holds exactly the ids its name says.
    failed = save / "after_failure"
    shards = sorted((failed / "shards").glob("*.parquet"))
    assert shards, "the first shard was committed before the disk filled"
    for p in shards:
        ids = pq.read_table(p, columns=["sample_id"])["sample_id"].to_pylist()
        assert f"shards/{p.name}" == shard_name(ids)
    assert not [p for p in (failed / "shards").iterdir() if p.name.startswith(".tmp-")]
    assert json.loads((failed / "manifest.json").read_text())["status"] == "running"

    # The rerun after space was freed: exit 0, every input row exactly once, verify passes.
    run2 = (save / "run2.log").read_text()
    assert (save / "rc2").read_text().strip() == "0", run2[-3000:]
    rows = [line for line in e2e_input.read_text().splitlines() if line.strip()]
    assert f"= {len(rows)} of {len(rows)} input rows" in run2
    assert "already committed" in run2
    report = verify(str(save / "after_rerun"))
    assert report.ok, report.problems

"""The output's disk fills up: a real ENOSPC from the filesystem, no partial shard committed, one clear line.

The output lives on a small tmpfs mounted in a user + mount namespace (`unshare`, no root needed where
unprivileged user namespaces are allowed). Skipped, saying why, where the kernel does not allow that.

- In the suite: the shard writer itself fills a 1 MiB tmpfs (seconds).
- Marked `long` (make test-long): the whole job, whose disk another process fills once the first shard is
  committed, then a rerun after space is freed that completes with every sample exactly once.
"""

from __future__ import annotations

import errno
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

# Inside the namespace: shards of random samples until the 1 MiB disk is full; what is left is reported as JSON
# (the tmpfs is gone once the namespace ends).
WRITER = r"""
import json, os, sys
import numpy as np
import pyarrow.parquet as pq
from pipeline.driver.failures import failure_message
from pipeline.format.shards import ShardLayout, shard_name, write_shard
from pipeline.format.storage import TMP_PREFIX, Store
from tests_support import random_encoded

out = sys.argv[1]
store, layout, rng = Store(out), ShardLayout((1, 2, 3), 64, encoding="raw"), np.random.default_rng(0)
committed, error = [], None
for k in range(100):
    samples = random_encoded(layout, f"s{k}", 4, 300, rng)
    try:
        committed.append(write_shard(store, samples, layout)[0])
    except OSError as e:
        error = {"errno": e.errno, "message": failure_message(e)}
        break
files = sorted(os.listdir(os.path.join(out, "shards")))
whole = [f"shards/{f}" == shard_name(pq.read_table(os.path.join(out, "shards", f), columns=["sample_id"])["sample_id"].to_pylist())
         for f in files if not f.startswith(TMP_PREFIX)]
print(json.dumps({"committed": committed, "files": files, "whole": whole, "error": error}))
"""

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


NEEDS_NAMESPACES = pytest.mark.skipif(
    not _namespaces_work(), reason="needs unprivileged user + mount namespaces (unshare) for a real tmpfs"
)


@NEEDS_NAMESPACES
def test_a_full_disk_during_a_shard_write_leaves_no_partial_shard_and_one_clear_line(tmp_path):
    disk = tmp_path / "disk"
    disk.mkdir()
    script = f'mount -t tmpfs -o size=1m tmpfs "{disk}" || exit 90; exec "{sys.executable}" -c "$WRITER" "{disk}/out"'
    proc = subprocess.run(
        ["unshare", "--user", "--map-root-user", "--mount", "bash", "-c", script],
        cwd=REPO,
        env=dict(os.environ, WRITER=WRITER, PYTHONPATH=f"{REPO}{os.pathsep}{REPO / 'tests'}"),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got["error"] is not None, "the disk never filled"
    assert got["error"]["errno"] == errno.ENOSPC
    message = got["error"]["message"]
    assert message.startswith("the run failed: OSError: [Errno 28] ") and "No space left on device" in message
    assert "free space and rerun the same command" in message
    # What was committed before is there, whole; the shard being written when the disk filled is not, not even
    # as a temporary.
    assert got["committed"] and [f"shards/{f}" for f in got["files"]] == sorted(got["committed"])
    assert all(got["whole"]) and len(got["whole"]) == len(got["committed"])


@pytest.mark.long
@NEEDS_NAMESPACES
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

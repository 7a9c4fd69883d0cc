"""`harvest regenerate` and `harvest run` with `generate` on a real SGLang server (CPU mode) and the default model:
the target's own turns in the input's schema, error rows for truncated turns, and exactly-once resume after a
SIGKILL of the driver."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from pipeline.format.manifest import read_manifest
from pipeline.format.regenerated import PROVENANCE, list_parts, read_part
from pipeline.format.shards import open_shards
from pipeline.format.storage import Store
from tests_support import sample_chats, sets

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[2]


def _chats(n: int, turns: int = 1) -> list[dict]:
    """n short conversations with `turns` assistant turns, shortest first (decode on 2 cores is slow)."""
    chats = [r for r in sample_chats() if sum(m["role"] == "assistant" for m in r["messages"]) == turns]
    return sorted(chats, key=lambda r: len(json.dumps(r)))[:n]


def _write(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _cmdline(p) -> str:
    try:
        return " ".join(p.cmdline())
    except psutil.Error:  # ended meanwhile
        return ""


def _rows(out: Path) -> list[dict]:
    store = Store(str(out))
    return [r for rel in list_parts(store) for r in read_part(store, rel)]


def test_run_with_generate_regenerates_then_extracts(ray_session, make_config, tmp_path):
    from pipeline.driver.regenerate import run_with_generation

    rows = _chats(5)
    src = _write(tmp_path / "in.jsonl", rows + [{"text": "not a conversation"}])
    gen_out, out = tmp_path / "regen", tmp_path / "states"
    cfg = make_config(
        src,
        out,
        **{"generate.output": str(gen_out), "generate.max_new_tokens": 24, "generate.policy": "last"},
    )
    summary = run_with_generation(cfg)
    t = summary.totals
    assert t["input_rows"] == len(rows) + 1 and t["accounted"] == t["input_rows"]
    regenerated = _rows(gen_out)
    assert len(regenerated) == t["rows_ok"] >= 1
    # Greedy answers of at most 24 tokens: the longer ones are cut off, and say so in their error rows.
    assert summary.reasons and all("truncated" in r or "conversation" in r for r, _ in summary.reasons)
    assert t["errors"] == len(rows) + 1 - t["rows_ok"]
    by_id = {r["id"]: r for r in rows if "id" in r}
    for r in regenerated:
        prov = r[PROVENANCE]
        assert prov["source"].startswith(str(src)) and prov["model"]["sha256"] and prov["chat_template_sha256"]
        assert prov["sampling"]["temperature"] == 0.0 and prov["turns"][0]["finish_reason"] == "stop"
        last = r["messages"][-1]
        assert last["role"] == "assistant" and last["content"].strip()
        if r["id"] in by_id:
            assert r["messages"][:-1] == by_id[r["id"]]["messages"][:-1]
    manifest = read_manifest(Store(str(gen_out)))
    assert manifest["status"] == "complete" and manifest["data_settings"]["policy"] == "last"

    # Extraction ran on what the model wrote, with the regenerated rows' ids.
    extracted = {s["sample_id"].split("#")[0] for s in open_shards(str(out), as_torch=False)}
    assert extracted == {r["id"] for r in regenerated}

    # A rerun finds everything committed: no new rows, the same totals.
    again = run_with_generation(cfg)
    assert again.this_run["rows_ok"] == 0 and again.totals == t


def _regenerate_cmd(src: Path, out: Path) -> list[str]:
    return [
        sys.executable,
        "-m",
        "pipeline.cli",
        "regenerate",
        str(REPO / "conf" / "regenerate.yaml"),
    ] + sets(
        f"input.path={src}",
        f"generate.output={out}",
        "generate.policy=each",
        "generate.max_new_tokens=16",
        "generate.on_truncated=keep",
        "generate.batch_size=1",
        "generate.batches_per_actor=2",
        "progress.interval_s=2",
        "ray.num_cpus=2",
        "ray.object_store_memory_mb=300",
    )


def test_each_policy_sigkill_then_rerun_is_exactly_once(tmp_path):
    rows = _chats(6, turns=2)
    src = _write(tmp_path / "in.jsonl", rows)
    out = tmp_path / "regen"
    env = dict(os.environ, RAY_ADDRESS="")  # its own local Ray, apart from the session's
    proc = subprocess.Popen(
        _regenerate_cmd(src, out), cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT
    )
    deadline = time.monotonic() + 400
    while time.monotonic() < deadline and proc.poll() is None:
        if len(list((out / "parts").glob("part-*.jsonl"))) >= 2:
            break
        time.sleep(0.3)
    assert proc.poll() is None, "finished before it could be killed:\n" + proc.stdout.read().decode()[-3000:]
    # The stage's actors are processes of their own (under the driver's local Ray): one may still commit the
    # part it is writing after the driver is gone. What the rerun finds committed is read once they have ended.
    actors = [p for p in psutil.Process(proc.pid).children(recursive=True) if "Regenerator" in _cmdline(p)]
    assert actors, "no Regenerator actor under the driver to wait for"
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    _, alive = psutil.wait_procs(actors, timeout=120)
    assert not alive, f"the killed driver's actors still run: {[p.pid for p in alive]}"
    before = {r["id"] for r in _rows(out)}
    assert 2 <= len(before) < len(rows)

    rerun = subprocess.run(_regenerate_cmd(src, out), cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert rerun.returncode == 0, rerun.stdout[-3000:] + rerun.stderr[-3000:]
    assert f"{len(before)} already committed" in rerun.stderr
    regenerated = _rows(out)
    ids = [r["id"] for r in regenerated]
    assert len(ids) == len(set(ids)) == len(rows)  # every row once (truncated turns are kept, flagged)
    totals = read_manifest(Store(str(out)))["totals"]
    assert totals["accounted"] == totals["input_rows"] == totals["rows_ok"] == len(rows)
    for r in regenerated:
        turns = r[PROVENANCE]["turns"]
        assert [t["message"] for t in turns] == [i for i, m in enumerate(r["messages"]) if m["role"] == "assistant"]
        assert all(t["finish_reason"] in ("stop", "length") for t in turns)
        assert (r[PROVENANCE]["flags"] == ["truncated"]) == any(t["finish_reason"] == "length" for t in turns)


def test_regenerate_reads_and_writes_s3_then_resumes_there(ray_session, s3_endpoint, make_config, tmp_path):
    import s3fs

    from pipeline.driver.regenerate import regenerate

    fs = s3fs.S3FileSystem()
    fs.mkdir("hh-regen")
    rows = _chats(3)
    fs.pipe("hh-regen/in/part-0.jsonl", "".join(json.dumps(r) + "\n" for r in rows).encode())
    out = "s3://hh-regen/regenerated"
    cfg = make_config(
        "s3://hh-regen/in/*.jsonl",
        tmp_path / "unused",
        **{"generate.output": out, "generate.max_new_tokens": 16, "generate.on_truncated": "keep"},
    )
    summary = regenerate(cfg)
    t = summary.totals
    assert t["input_rows"] == t["accounted"] == t["rows_ok"] == len(rows)
    assert read_manifest(Store(out))["status"] == "complete"
    regenerated = _rows(out)
    assert len(regenerated) == len(rows) and {r["id"] for r in rows if "id" in r} <= {r["id"] for r in regenerated}
    assert all(r[PROVENANCE]["source"].startswith("s3://hh-regen/in/part-0.jsonl:") for r in regenerated)
    again = regenerate(cfg)  # resumed from the parts on object storage: nothing twice
    assert again.this_run["rows_ok"] == 0 and again.totals == t and len(_rows(out)) == len(rows)

"""Every fault the hook can inject is caught, retried, and never stored; clean samples are stored once.

Faults are switched on only here, through the server's environment (patches/.../hidden_harvest_faults.py):
wrong token count, dumps swapped between requests, truncated dump, non-finite values, missing dump, dump
published after the client stopped waiting, and the server killed mid-request.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import numpy as np
import pytest

from actors.sglang.engine import SGLangEngine
from actors.validate import check_capture
from pipeline.format.manifest import read_manifest
from pipeline.format.shards import open_shards
from pipeline.format.storage import Store
from pipeline.tools.verify import verify
from tests_support import harvest_command, sets

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[2]
ALL_FAULTS = "wrong_count:0.07,wrong_rid:0.1,truncated:0.07,nan:0.07,missing:0.07,late:0.07,kill:0.1"


def fault_env(log: Path, faults: str = ALL_FAULTS) -> dict:
    # A late dump appears LATE_S after the hook ran; the client waits dump_timeout_s (1.5 s) after the HTTP
    # answer, which leaves the hook a moment later. With 3 s, a busy machine that delivered one answer more
    # than 1.5 s after its forward saw the late dump inside the client's wait: accepted, rightly (it is that
    # request's own data), but then not a fault the client could catch. 10 s keeps every late dump late.
    return {
        "HIDDEN_HARVEST_FAULTS": faults,
        "HIDDEN_HARVEST_FAULT_LOG": str(log),
        "HIDDEN_HARVEST_FAULT_LATE_S": "10",
    }


def prompts(n: int) -> dict[str, list[int]]:
    """Distinct prompts (a swapped dump is then always the wrong data), several of the same length."""
    rng = np.random.default_rng(7)
    return {f"p{i}": rng.integers(100, 49000, 8 + (i % 6) * 7).tolist() for i in range(n)}


def test_every_injected_fault_is_caught_and_retried(model_dir, references, tmp_path):
    log = tmp_path / "faults.jsonl"
    # The server computes in float32, so an accepted capture is its prompt's own states up to bf16 storage
    # rounding, on any CPU: in bf16, one healthy 8-token prompt here measured 3.8x the bf16 yardstick's
    # distance on a CPU without native bf16 matmul (the rule allows 3.5x), failing the check on a clean capture.
    spec = {
        "model_dir": model_dir,
        "aux_layers": (2, 15, 27),
        "cpu": True,
        "env": fault_env(log),
        "extra_flags": ("--dtype", "float32"),
    }
    # 96 prompts: with 48 about 20 faults fell, and a kind could miss out altogether (one run had no `missing`).
    todo = prompts(96)
    accepted: dict[str, object] = {}
    rejected_rids: set[str] = set()
    with SGLangEngine(spec, max_in_flight=8, request_timeout_s=120, dump_timeout_s=1.5) as engine:
        # The extractor's bounded retries, with rounds enough that every sample gets through: about 0.45 of
        # dumps carry a fault here, so with 8 rounds one of 96 samples stayed faulty in ~1 run of 6 (seen once
        # in CI); with 30, ~1e-9. The rounds end as soon as nothing is pending.
        for _ in range(30):
            pending = {k: v for k, v in todo.items() if k not in accepted}
            if not pending:
                break
            engine.ensure_alive()
            for key, res in engine.capture(list(pending.items())).items():
                reason = res.error or check_capture(res.capture, pending[key], 3 * 576, 576)
                if reason is None:
                    accepted[key] = res
                else:
                    rejected_rids.add(res.rid)
        accepted_rids = {r.rid for r in accepted.values()}
        bits = {k: r.capture.bits() for k, r in accepted.items()}
    injected = [json.loads(line) for line in log.read_text().splitlines()]
    kinds = {f["fault"] for f in injected}
    caught = [f for f in injected if f["rid"] in rejected_rids and f["rid"] not in accepted_rids]
    missed = [f for f in injected if f not in caught]
    print(f"faults caught / injected: {len(caught)} / {len(injected)} ({sorted(kinds)}); missed: {missed}")
    assert len(caught) == len(injected) and len(injected) >= 10
    assert kinds == {"wrong_count", "wrong_rid", "truncated", "nan", "missing", "late", "kill"}
    assert set(accepted) == set(todo)  # every sample got through in the end

    # What was accepted is each prompt's own hidden states: within bf16 noise of a float32 forward of it.
    for key, ids in todo.items():
        references.check(key, (2, 15, 27), ids, *bits[key])


# ~3 minutes here (its own Ray and server, a server restart, the retries). In the suite, in small: every fault
# caught at the engine (above), an actor killed mid-run and its batch retried (test_scale_out.py).
@pytest.mark.long
def test_job_under_faults_stores_every_clean_sample_once(e2e_input, harvest_output, references, tmp_path):
    """The whole job with every fault on: all samples stored exactly once (the fault-free run's samples),
    verify passes, and each stored sample is within bf16 noise of a float32 forward of its own tokens."""
    out, log = tmp_path / "out", tmp_path / "faults.jsonl"
    cmd = harvest_command(
        e2e_input, out, *sets("extract.batch_size=8", "extract.retries=5", "engine.dump_timeout_s=1.5")
    )
    # Every kind, the server kills rarer: each costs a server restart (~30 s here), and the test above
    # already shows that every kind is caught.
    env = dict(os.environ, RAY_ADDRESS="", **fault_env(log, ALL_FAULTS.replace("kill:0.1", "kill:0.03")))
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    injected = log.read_text().splitlines()
    assert len(injected) >= 3, "no faults were injected"
    report = verify(str(out))
    assert report.ok, report.text(str(out))
    clean = {s["sample_id"]: s for s in open_shards(harvest_output, as_torch=False)}
    stored = {s["sample_id"]: s for s in open_shards(str(out), as_torch=False)}
    assert set(stored) == set(clean)
    print(f"job under faults: {len(injected)} injected, {len(stored)} samples stored once each, verify OK")
    layers = read_manifest(Store(str(out)))["aux_layers"]
    for sid, s in stored.items():
        np.testing.assert_array_equal(s["input_ids"], clean[sid]["input_ids"])
        references.check(sid, layers, s["input_ids"], s["aux_hidden_states"], s["last_hidden_state"])

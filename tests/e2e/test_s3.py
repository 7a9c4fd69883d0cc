"""Object storage: the real job reads its input from and writes shards + manifest to a real S3 endpoint."""

from __future__ import annotations

import json

import pytest

pytestmark = pytest.mark.slow


def test_job_reads_and_writes_s3_then_resumes_there(ray_session, s3_endpoint, e2e_input, make_config):
    import s3fs

    from pipeline.driver.job import run
    from pipeline.format.manifest import read_manifest
    from pipeline.format.shards import open_shards
    from pipeline.format.storage import Store
    from pipeline.tools.verify import verify

    fs = s3fs.S3FileSystem()
    fs.mkdir("hh-bucket")
    lines = [line for line in e2e_input.read_text().splitlines() if line.strip()][:10]
    fs.pipe("hh-bucket/in/part-0.jsonl", ("\n".join(lines[:6]) + "\n").encode())
    fs.pipe("hh-bucket/in/part-1.jsonl", ("\n".join(lines[6:]) + "\n").encode())
    out = "s3://hh-bucket/runs/first"

    summary = run(make_config("s3://hh-bucket/in/*.jsonl", out))
    t = summary.totals
    assert t["input_rows"] == 10 and t["accounted"] == 10 and t["samples_ok"] >= 8
    assert fs.exists("hh-bucket/runs/first/manifest.json")
    shards = fs.glob("hh-bucket/runs/first/shards/*.parquet")
    assert len(shards) == t["shards"] >= 2
    assert t["bytes"] == sum(fs.size(s) for s in shards)

    manifest = read_manifest(Store(out))
    text = json.dumps(manifest)
    assert "hh-test-secret" not in text and "hh-test-key" not in text and s3_endpoint not in text

    report = verify(out)
    assert report.ok, report.problems
    samples = list(open_shards(out))
    assert len(samples) == t["samples_ok"]
    assert samples[0]["aux_hidden_states"].shape[0] == samples[0]["num_tokens"]

    again = run(make_config("s3://hh-bucket/in/*.jsonl", out))
    assert again.this_run.done == 0
    assert again.totals == t

    # Exports read from and write to object storage too, and a rerun there writes nothing twice.
    from pipeline.tools.export import export

    dest = "s3://hh-bucket/exports/speculators"
    first = export(out, "speculators", dest, draft_vocab=64)
    assert first.ok and first.written == t["samples_ok"], first.text()
    assert fs.exists("hh-bucket/exports/speculators/state.json")  # the rows folder speculators loads
    assert fs.exists("hh-bucket/exports/speculators/d2t-64.npy") and fs.exists(
        "hh-bucket/exports/speculators/t2d-64.npy"
    )
    again = export(out, "speculators", dest)
    assert again.ok and again.written == 0 and again.skipped == t["samples_ok"]
    assert export(out, "specforge", "s3://hh-bucket/exports/specforge").ok

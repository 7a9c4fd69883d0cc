import json

from pipeline.format.errors import DUPLICATES, reopen_transient_errors
from pipeline.format.manifest import committed_totals
from pipeline.format.storage import Store


def rows(*stages):
    return "".join(
        json.dumps({"sample_id": f"s-{i}-{st}", "source": f"f:{i}", "status": "error", "stage": st, "reason": "r"})
        + "\n"
        for i, st in enumerate(stages)
    )


def test_only_transient_errors_are_reopened_and_totals_stay_exact(tmp_path):
    store = Store(str(tmp_path))
    store.write_bytes("errors/part-a.jsonl", rows("parse", "extract", "tokenize").encode())
    store.write_bytes("errors/part-b.jsonl", rows("extract", "engine").encode())
    store.write_bytes("errors/part-c.jsonl", rows("read").encode())
    store.write_bytes(
        DUPLICATES, json.dumps({"source": "f:9", "status": "filtered", "stage": "dedup", "reason": "d"}).encode()
    )
    assert committed_totals(store)["errors"] == 6
    assert reopen_transient_errors(store) == 3
    assert store.list("errors") == ["errors/duplicates.jsonl", "errors/part-a.jsonl", "errors/part-c.jsonl"]
    kept = [json.loads(line)["stage"] for line in store.read_bytes("errors/part-a.jsonl").decode().splitlines()]
    assert kept == ["parse", "tokenize"]
    assert committed_totals(store)["errors"] == 3
    assert reopen_transient_errors(store) == 0

"""The regeneration stage on a stand-in engine: turn order under `each`, error rows, flags, exactly one commit."""

import json
import threading
from concurrent.futures import ThreadPoolExecutor

import pyarrow as pa
import pytest

import actors.regenerator as regenerator_module
from actors.engine import GenerateResult
from actors.regenerator import Regenerator, sample_seed
from pipeline.format.errors import error_files, read_errors
from pipeline.format.regenerated import PROVENANCE, committed_ids, committed_totals, list_parts, read_part
from pipeline.format.storage import Store
from pipeline.intake.conversation import RegenerationCodec, identify_lines


class StandIn:
    """Answers `turn <n>` for the n-th request of a key; `length` / `empty` / `fail` keys misbehave."""

    def __init__(self, **_):
        self.pool = ThreadPoolExecutor(4)
        self.lock = threading.Lock()
        self.prompts: dict[str, list[list[int]]] = {}
        self.seeds: dict[str, list[int]] = {}

    def start(self):
        return self

    def close(self):
        self.pool.shutdown()

    def ensure_alive(self):
        pass

    def submit_generate(self, key, ids, sampling):
        with self.lock:
            self.prompts.setdefault(key, []).append(list(ids))
            self.seeds.setdefault(key, []).append(sampling["seed"])
            n = len(self.prompts[key])
        return self.pool.submit(self._answer, key, n)

    def _answer(self, key, n):
        if key.startswith("fail"):
            return GenerateResult(key, [], "", "", "server answered 500: boom")
        if key.startswith("length"):
            return GenerateResult(key, [5] * 8, "cut off", "length", None)
        if key.startswith("empty"):
            return GenerateResult(key, [2], " ", "stop", None)
        return GenerateResult(key, [7, n], f"turn {n} of {key}", "stop", None)


MSGS = [
    {"role": "user", "content": "a?"},
    {"role": "assistant", "content": "old 1"},
    {"role": "user", "content": "b?"},
    {"role": "assistant", "content": "old 2"},
]


@pytest.fixture
def stage(model_dir, tmp_path, monkeypatch):
    engines = []

    def make(policy="each", **kw):
        def cls(_name):
            def build(**_):
                engines.append(StandIn())
                return engines[-1]

            return build

        monkeypatch.setattr(regenerator_module, "generator_class", cls)
        codec = RegenerationCodec(str(model_dir), {}, "id", policy, False)
        sampling = {"temperature": 0.0, "top_p": 1.0, "max_new_tokens": 8, "seed": 3}
        st = Regenerator("stand-in", {}, codec, sampling, str(tmp_path / "out"), {"engine": "stand-in"}, **kw)
        return st, engines[-1]

    return make


def _batch(*ids):
    lines = [json.dumps({"id": i, "messages": MSGS}) for i in ids] + [json.dumps({"text": "no chat"})]
    table = pa.table({"source": [f"in.jsonl:{k + 1}" for k in range(len(lines))], "line": lines})
    return identify_lines(table)


def test_each_generates_turn_by_turn_from_the_regenerated_turns(stage, model_dir, tmp_path):
    from transformers import AutoTokenizer

    st, engine = stage("each")
    out = st(_batch("a", "b")).to_pylist()
    assert sorted((r["sample_id"], r["status"], r["turns"]) for r in out if r["status"] == "ok") == [
        ("a", "ok", 2),
        ("b", "ok", 2),
    ]
    tok = AutoTokenizer.from_pretrained(model_dir)
    first, second = (tok.decode(p) for p in engine.prompts["a"])
    assert "turn 1 of a" in second and "old 1" not in second and "turn 1" not in first
    store = Store(str(tmp_path / "out"))
    rows = {r["id"]: r for rel in list_parts(store) for r in read_part(store, rel)}
    assert [m["content"] for m in rows["a"]["messages"]] == ["a?", "turn 1 of a", "b?", "turn 2 of a"]
    prov = rows["a"][PROVENANCE]
    assert prov["source"] == "in.jsonl:1" and prov["engine"] == "stand-in"
    assert [t["message"] for t in prov["turns"]] == [1, 3]
    assert [t["seed"] for t in prov["turns"]] == [sample_seed(3, "a", 1), sample_seed(3, "a", 3)]
    assert engine.seeds["a"] == [sample_seed(3, "a", 1), sample_seed(3, "a", 3)]
    assert committed_ids(store) == {"a", "b", next(r["sample_id"] for r in out if r["stage"] == "parse")}


def test_truncated_empty_and_failed_become_error_rows_with_reasons(stage, tmp_path):
    st, _ = stage("last", retries=1)
    out = {r["sample_id"]: r for r in st(_batch("ok1", "length1", "empty1", "fail1")).to_pylist()}
    assert out["ok1"]["status"] == "ok"
    assert out["length1"]["stage"] == "generate" and "truncated" in out["length1"]["reason"]
    assert out["empty1"]["stage"] == "generate" and "empty" in out["empty1"]["reason"]
    assert out["fail1"]["stage"] == "engine" and "after 2 attempts" in out["fail1"]["reason"]
    assert out["length1"]["completion_tokens"] == 8  # generated, though not kept
    store = Store(str(tmp_path / "out"))
    errors = {e.sample_id: e for rel in error_files(store) for e in read_errors(store, rel)}
    assert set(errors) == {s for s, r in out.items() if r["status"] != "ok"}
    assert {"length1", "empty1", "fail1"} <= set(errors) and "ok1" not in errors
    totals = committed_totals(store)
    assert (totals["rows_ok"], totals["errors"]) == (1, 4)


def test_kept_truncated_and_empty_turns_are_flagged(stage, tmp_path):
    st, _ = stage("last", on_truncated="keep", on_empty="keep")
    out = {r["sample_id"]: r for r in st(_batch("length1", "empty1")).to_pylist()}
    assert out["length1"]["status"] == out["empty1"]["status"] == "ok"
    assert out["length1"]["flagged"] and out["empty1"]["flagged"]
    store = Store(str(tmp_path / "out"))
    rows = {r["id"]: r for rel in list_parts(store) for r in read_part(store, rel)}
    assert rows["length1"][PROVENANCE]["flags"] == ["truncated"]
    assert rows["length1"][PROVENANCE]["turns"][0]["finish_reason"] == "length"
    assert rows["empty1"][PROVENANCE]["flags"] == ["empty"]
    assert committed_totals(store)["flagged"] == 2


def test_seeds_depend_on_the_sample_and_turn_only():
    assert sample_seed(0, "a", 1) == sample_seed(0, "a", 1)
    assert len({sample_seed(0, "a", 1), sample_seed(1, "a", 1), sample_seed(0, "b", 1), sample_seed(0, "a", 3)}) == 4
    assert 0 <= sample_seed(5, "x", 0) < 2**63

"""bench_job_ab: each run's job comes from its own checkout (driver and actors), and its tail is read right."""

import json
import os
import shutil
from pathlib import Path

from bench.bench_job_ab import summary, tail
from bench.bench_job_gpu import ROOT, job, window


def checkout(dest: Path) -> Path:
    for part in ("pipeline", "actors", "patches", "conf"):
        shutil.copytree(ROOT / part, dest / part, ignore=shutil.ignore_patterns("__pycache__"))
    return dest


def test_the_job_runs_the_code_of_the_checkout_it_is_given(model_dir, tmp_path):
    """A checkout whose extractor leaves a mark and raises in its constructor (which only the actor runs): the mark
    is there, from another process, and the job failed: the actors imported the checkout, not the installed
    project. (The mark, not the job's log: Ray's dump of the dying worker can push the traceback out of it.)"""
    tree = checkout(tmp_path / "tree")
    mark = tmp_path / "mark"
    source = tree / "actors" / "extractor.py"
    text = source.read_text()
    anchor = "        self.init_unix = time.time()"
    assert anchor in text
    planted = f"        open({str(mark)!r}, 'w').write(str(os.getpid()))\n        raise RuntimeError('planted')\n"
    source.write_text(text.replace(anchor, planted + anchor, 1))
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(
        "".join(json.dumps({"id": f"p{i}", "input_ids": list(range(5, 40 + i))}) + "\n" for i in range(4))
    )
    r = job(tmp_path / "work", model_dir, prompts, 1, None, "cpu", None, None, max_tokens=256, verify=False, tree=tree)
    assert r.get("failed"), "the job ran from the installed project, not the checkout"
    assert mark.is_file(), "the job failed, but not in the checkout's actor"
    assert int(mark.read_text()) != os.getpid()


def run(tree: str, tok_s: float, done: float, committed: float) -> dict:
    engine = {
        "first_forward_unix": done - 30.0,
        "last_done_unix": done,
        "batch_captured_unix": done + 0.1,
        "batch_encoded_unix": done + 0.2,
        "batch_committed_unix": committed,
        "shard_io": {"bytes": 4_000_000_000, "write_s": 2.0},
        "padded_tokens": 100,
        "real_tokens": 100,
    }
    last_run = {
        "engines_ready_unix": done - 31.0,
        "last_result_unix": committed + 0.02,
        "per_actor": {"a": {"engine": engine}},
    }
    return {"tree": tree, "tok_s": tok_s, "us_per_padded_token": 30.0, "tail": tail({"window": window(last_run)})}


def test_the_tail_is_taken_apart_from_the_engines_last_results_and_the_medians_compared():
    r = run("before", 100.0, 1000.0, 1001.25)
    assert r["tail"] == {"captured_after_s": 0.1, "encoded_after_s": 0.2, "committed_after_s": 1.25, "write_gb_s": 2.0}
    runs = [r, run("after", 110.0, 5.0, 5.5), run("after", 104.0, 5.0, 5.3), run("before", 96.0, 5.0, 6.0)]
    s = summary(runs, ["before", "after"])
    assert s["before"]["tok_s_median"] == 98.0 and s["after"]["tok_s_median"] == 107.0
    assert s["after"]["tok_s_ratio_to_before"] == round(107 / 98, 4)
    assert s["before"]["tail_s_median"] == 1.125 and s["after"]["tail_s_median"] == 0.4

"""The audit rule on clean SGLang captures in bf16 and in float32 on this CPU, in one run.

  python bench/probes/bench_rule_cpu_dtype.py [--out bench/results/rule_cpu_dtype.json]

test_faults' 96 random-token prompts (8-43 tokens) through SGLangEngine with no faults, once with the model's
dtype and once with --dtype float32, each sample's layers judged by DEFAULT_RULE against the float32 truth and
bf16 yardstick of transformers (tests_support.References). Records per dtype the failures and the largest
sample-mean ratios (mean distance / the yardstick's), beside whether the CPU multiplies bf16 natively.
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "bench"))

from bench_throughput import command_line, machine  # noqa: E402

from actors.sglang.engine import SGLangEngine  # noqa: E402
from pipeline.intake.model import prepare_default_model  # noqa: E402
from pipeline.tools.fidelity import DEFAULT_RULE, FINAL_DEPTH  # noqa: E402
from tests_support import References, stored_blocks  # noqa: E402

AUX = (2, 15, 27)


def judge(model_dir, todo: dict, refs: References, flags: tuple[str, ...]) -> dict:
    spec = {"model_dir": model_dir, "aux_layers": AUX, "cpu": True, "extra_flags": flags}
    with SGLangEngine(spec, max_in_flight=8, request_timeout_s=120, dump_timeout_s=5) as engine:
        bits = {k: r.capture.bits() for k, r in engine.capture(list(todo.items())).items()}
    rows = []
    for key, ids in todo.items():
        ((truth, yard),) = refs.layers(AUX, [ids])
        out = DEFAULT_RULE.judge_layers(stored_blocks(*bits[key], len(AUX)), truth, yard, [*AUX, FINAL_DEPTH])
        for name, d in zip([*(f"aux {a}" for a in AUX), "final"], out):
            rows.append((round(d.mean_error / max(d.noise_error, 1e-9), 2), key, name, d.passed))
    rows.sort(reverse=True)
    return {
        "failed": [{"sample": k, "layer": n, "ratio": r} for r, k, n, ok in rows if not ok],
        "largest_ratios": [{"sample": k, "layer": n, "ratio": r} for r, k, n, _ in rows[:5]],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "rule_cpu_dtype.json")
    args = ap.parse_args()
    model_dir = prepare_default_model()
    rng = np.random.default_rng(7)  # test_faults' prompts
    todo = {f"p{i}": rng.integers(100, 49000, 8 + (i % 6) * 7).tolist() for i in range(96)}
    refs = References(model_dir)
    result = {
        "benchmark": "the audit rule on clean SGLang captures, bf16 against float32 compute, CPU",
        "command": command_line(),
        "machine": machine(),
        "date": datetime.date.today().isoformat(),
        "rule": {"sample_factor": DEFAULT_RULE.sample_factor, "token_factor": DEFAULT_RULE.token_factor},
        "model_dtype": judge(model_dir, todo, refs, ()),
        "float32": judge(model_dir, todo, refs, ("--dtype", "float32")),
    }
    refs.close()
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()

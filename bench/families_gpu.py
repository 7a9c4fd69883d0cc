"""The family checks of tests/e2e/test_families.py on a GPU: each family's tiny random-init model through the real
job with the hf engine on CUDA, then `harvest audit --samples all --device cuda`, then each sample damaged four
ways and judged against the same reference (tests/tests_support.damaged_samples_fail); one JSON of what happened.

  python bench/families_gpu.py --tokenizer DIR --work DIR [--families qwen3,gemma3_text,...]
                               [--json bench/results/families_h200.json]

DIR for --tokenizer: the default model's tokenizer files (the models get it, as in the tests). Each run's
log tail and the audit's per-layer summary are kept, so a failure says why.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

from families import FAMILIES, make_model, prompt_lines  # noqa: E402


def _harvest(*args: str, timeout: int = 900) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "pipeline.cli", *args], cwd=ROOT, capture_output=True, text=True, timeout=timeout
    )


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokenizer", type=Path, required=True)
    ap.add_argument("--work", type=Path, required=True)
    ap.add_argument("--families", default=",".join(FAMILIES))
    ap.add_argument("--json", type=Path, default=ROOT / "bench" / "results" / "families_h200.json")
    args = ap.parse_args()
    args.work.mkdir(parents=True, exist_ok=True)
    prompts = args.work / "prompts.jsonl"
    prompts.write_text("\n".join(prompt_lines(args.tokenizer)) + "\n")
    result = {
        "benchmark": "tiny random-init model per family through the job (hf engine, CUDA) and harvest audit --device cuda",
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, GPU: "
        + subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True, text=True)
        .stdout.strip()
        .replace("\n", ", "),
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d"),
        "command": "python bench/families_gpu.py --tokenizer TOKENIZER_DIR --work WORK --families " + args.families,
        "families": {},
    }
    for family in args.families.split(","):
        model = make_model(family, args.work / f"model-{family}", args.tokenizer)
        out = args.work / f"out-{family}"
        t0 = time.monotonic()
        run = _harvest(
            "run",
            "conf/default.yaml",
            *("--set", f"model.path={model}", "--set", f"input.path={prompts}", "--set", f"output.path={out}"),
            *("--set", "engine.name=hf", "--set", "engine.device=cuda"),
        )
        entry = {"run_rc": run.returncode, "run_seconds": round(time.monotonic() - t0, 1)}
        if run.returncode == 0:
            audit = _harvest("audit", str(out), "--samples", "all", "--device", "cuda")
            entry["audit_rc"] = audit.returncode
            entry["audit"] = [line for line in audit.stdout.splitlines() if line.strip()][-8:]
            report = json.loads((out / "audit.json").read_text())
            entry["per_layer"] = {
                k: {
                    "worst_sample_ratio": round(v["max_ratio"], 3),
                    "min_cosine": round(v["min_cosine"], 5),
                    "routing_near_tie_tokens": v.get("routing_near_tie_tokens", 0),
                }
                for k, v in report["per_layer"].items()
            }
            entry["worst_excess"] = round(max(r["excess"] for r in report["results"]), 3)
            try:
                from tests_support import damaged_samples_fail

                caught, routers = damaged_samples_fail(out, "cuda")
                entry["damage"] = {"all_caught": True, "kinds": caught, "moe_layers": sorted(routers)}
            except AssertionError as e:
                entry["damage"] = {"all_caught": False, "error": str(e)[:1000]}
        else:
            entry["log_tail"] = (run.stderr or run.stdout)[-1500:]
        result["families"][family] = entry
        print(family, {k: v for k, v in entry.items() if k != "audit"}, flush=True)
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=2) + "\n")  # after every family: a cut-short run keeps them
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()

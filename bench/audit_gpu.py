"""The audit on a large model's healthy output, on a GPU: a Qwen3-8B-shaped random-init model (36 layers,
H 4096, MLP 12288, GQA 32/8) captured in bf16 by the real job (hf engine, CUDA), then `harvest audit --samples all
--device cuda`, then each sample damaged four ways and judged against the same reference (tests/tests_support.py
damaged_samples_fail): the healthy output must pass on every sample and layer, every damaged sample fail.

  python bench/audit_gpu.py --tokenizer DIR --work DIR [--prompts 48] [--json bench/results/audit_8b_h200.json]

Prompts: a third the shipped conversations (tests/families.prompt_lines), the rest random token ids with lengths
log-uniform in 64-4096 (early positions of random prompts are where bf16 strays furthest from float32).
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "bench"))

from families_gpu import _harvest  # noqa: E402  (the harvest CLI in a subprocess, as the family bench runs it)

SHAPE = dict(
    hidden_size=4096,
    intermediate_size=12288,
    num_hidden_layers=36,
    num_attention_heads=32,
    num_key_value_heads=8,
    head_dim=128,
    max_position_embeddings=8192,
)


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def make_model(path: Path, tokenizer: Path) -> Path:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, Qwen3Config

    if (path / "config.json").is_file():
        return path
    tok = AutoTokenizer.from_pretrained(tokenizer)
    cfg = Qwen3Config(
        vocab_size=len(tok),
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        tie_word_embeddings=False,
        **SHAPE,
    )
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
        with torch.no_grad():  # scaled as trained models are (tests/families.py)
            for p in model.parameters():
                if p.dim() >= 2:
                    p.normal_(0.0, 0.02)
    model.save_pretrained(path, safe_serialization=True)
    tok.save_pretrained(path)
    del model
    torch.cuda.empty_cache()
    return path


def make_prompts(path: Path, tokenizer: Path, n: int, vocab: int) -> dict:
    import numpy as np

    from families import prompt_lines

    real = prompt_lines(tokenizer, n // 3)
    rng = np.random.default_rng(7)
    lines = list(real)
    for i in range(n - len(real)):
        length = int(math.exp(rng.uniform(math.log(64), math.log(4096))))
        lines.append(json.dumps({"id": f"rand-{i}", "input_ids": rng.integers(100, vocab, length).tolist()}))
    path.write_text("\n".join(lines) + "\n")
    lengths = [len(json.loads(x)["input_ids"]) for x in lines]
    return {"count": len(lines), "real": len(real), "tokens": sum(lengths), "min": min(lengths), "max": max(lengths)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokenizer", type=Path, required=True)
    ap.add_argument("--work", type=Path, required=True)
    ap.add_argument("--prompts", type=int, default=48)
    ap.add_argument("--damage-samples", type=int, default=16, help="samples damaged (each four ways)")
    ap.add_argument("--json", type=Path, default=ROOT / "bench" / "results" / "audit_8b_h200.json")
    args = ap.parse_args()
    args.work.mkdir(parents=True, exist_ok=True)
    gpu = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True, text=True)
    result = {
        "benchmark": "harvest audit on a healthy bf16 output of a Qwen3-8B-shaped model, and on that output damaged",
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, GPU: {gpu.stdout.strip()}",
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d"),
        "command": f"python bench/audit_gpu.py --tokenizer TOKENIZER_DIR --work WORK --prompts {args.prompts}",
        "model": {"family": "qwen3", **SHAPE, "weights": "random init N(0, 0.02), bf16"},
    }
    t0 = time.monotonic()
    model = make_model(args.work / "model-qwen3-8b", args.tokenizer)
    result["model_seconds"] = round(time.monotonic() - t0, 1)
    from pipeline.intake.model import vocab_size

    prompts = args.work / "prompts.jsonl"
    result["prompts"] = make_prompts(prompts, args.tokenizer, args.prompts, vocab_size(model))
    out = args.work / "out"
    t0 = time.monotonic()
    run = _harvest(
        "run",
        "conf/default.yaml",
        *("--set", f"model.path={model}", "--set", f"input.path={prompts}", "--set", f"output.path={out}"),
        *("--set", "engine.name=hf", "--set", "engine.device=cuda"),
    )
    result["run"] = {"rc": run.returncode, "seconds": round(time.monotonic() - t0, 1)}
    args.json.parent.mkdir(parents=True, exist_ok=True)

    def save() -> None:  # after every step: a run cut short keeps what it measured
        args.json.write_text(json.dumps(result, indent=2) + "\n")

    save()
    log(f"run rc {run.returncode}")
    if run.returncode != 0:
        result["run"]["log_tail"] = (run.stderr or run.stdout)[-3000:]
    else:
        t0 = time.monotonic()
        audit = _harvest("audit", str(out), "--samples", "all", "--device", "cuda")
        report = json.loads((out / "audit.json").read_text())
        rs = report["results"]
        result["audit"] = {
            "rc": audit.returncode,
            "seconds": round(time.monotonic() - t0, 1),
            "passed": report["passed"],
            "summary": [line for line in audit.stdout.splitlines() if line.strip()][-8:],
            "worst_sample_mean_over_allowed": round(max(r["mean_error"] / r["sample_allowed"] for r in rs), 3),
            "worst_token_over_allowed": round(max(r["worst_error"] / r["worst_allowed"] for r in rs), 3),
            "worst_largest_element_over_allowed": round(max(r["peak_error"] / r["peak_allowed"] for r in rs), 3),
            "worst_excess": round(max(r["excess"] for r in rs), 3),
            "min_cosine": round(min(r["min_cosine"] for r in rs), 5),
            "per_layer": report["per_layer"],
            "failures": report["failures"][:10],
        }
        log(f"audit rc {audit.returncode}")
        save()
        t0 = time.monotonic()
        try:
            from tests_support import damaged_samples_fail

            caught, _ = damaged_samples_fail(out, "cuda", max_samples=args.damage_samples)
            result["damage"] = {"all_caught": True, "kinds": caught}
        except AssertionError as e:
            result["damage"] = {"all_caught": False, "error": str(e)[:2000]}
        result["damage"]["seconds"] = round(time.monotonic() - t0, 1)
    save()
    print(
        json.dumps(
            {k: v for k, v in result.items() if k != "audit"}
            | {"audit": {k: v for k, v in result.get("audit", {}).items() if k not in ("per_layer",)}},
            indent=2,
        )
    )


if __name__ == "__main__":
    main()

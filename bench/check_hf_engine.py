"""The hf engine's captures against a plain transformers forward of each request alone, on one device.

  python bench/check_hf_engine.py MODEL_DIR [--device cuda|cpu]

Exits 1 unless every request's stored bits (aux layers = HF hidden_states[i+1], final = after the norm)
are within bf16 noise of a float32 forward of the request alone (judged by the same request's bf16 forward), padding included nowhere, validation passing.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from actors.hf.engine import HFEngine  # noqa: E402
from actors.validate import check_capture  # noqa: E402
from pipeline.tools.fidelity import DEFAULT_RULE  # noqa: E402


def _layers(model, ids, aux_layers, device) -> list:
    import torch

    with torch.inference_mode():
        out = model.model(input_ids=torch.tensor([ids], device=device), output_hidden_states=True)
    return [out.hidden_states[i + 1][0].float().cpu() for i in aux_layers] + [out.last_hidden_state[0].float().cpu()]


def check(model_dir: str, device: str = "cpu", lengths=(5, 40, 33, 120, 7, 64, 300), aux_layers=(1, 2, 3)) -> list[str]:
    import torch
    from transformers import AutoModelForCausalLM

    rng = np.random.default_rng(0)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).to(device).eval()
    truth_model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).to(device).eval()
    vocab, h = model.config.vocab_size, model.config.hidden_size
    reqs = [(f"s{i}", rng.integers(0, vocab, size=n).tolist()) for i, n in enumerate(lengths)]
    problems = []
    with HFEngine(model_dir, aux_layers, device=device, max_batch_tokens=512) as eng:
        res = eng.capture(reqs)
        if eng.batches >= len(reqs):
            problems.append(f"{len(reqs)} requests ran in {eng.batches} forwards: nothing was batched")
    for key, ids in reqs:
        r = res[key]
        reason = r.error or check_capture(r.capture, ids, len(aux_layers) * h, h)
        if reason:
            problems.append(f"{key}: {reason}")
            continue
        aux, last = r.capture.bits()
        got = [aux[:, k * h : (k + 1) * h] for k in range(len(aux_layers))] + [last]
        # The float32 truth, and this request alone through transformers in bf16 as the noise yardstick.
        truth, yard = (_layers(m, ids, aux_layers, device) for m in (truth_model, model))
        for name, g, t, y in zip([f"aux layer {i}" for i in aux_layers] + ["final"], got, truth, yard):
            d = DEFAULT_RULE.judge(g, t, y)
            if not d.passed:
                problems.append(f"{key} {name}: {d.why()}")
    return problems


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("model_dir")
    ap.add_argument("--device", default="cuda")
    a = ap.parse_args()
    found = check(a.model_dir, a.device)
    print("hf engine check:", "PASS" if not found else "FAIL\n  " + "\n  ".join(found))
    sys.exit(1 if found else 0)

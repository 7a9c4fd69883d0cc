"""Where the bf16-noise rule's factors come from (pipeline/tools/fidelity.py): healthy SGLang captures and
damaged copies of them, judged against the audit's reference, in one run.

  python bench/bench_noise_rule.py OUTPUT [--random 60] [--out bench/results/noise_rule.json]

OUTPUT: a job's output whose samples (real conversations) are captured again here, with `--random`
random-token prompts (8-300 tokens, the hardest case for bf16: early tokens stray far from float32).
A real SGLang server in CPU mode captures them at aux layers 2, 14, 15, 16, 27; the reference
(pipeline/tools/audit.Reference) gives the float32 truth and the bf16 yardsticks. Printed and recorded,
per quantity the worst case over every sample and stored layer:

  healthy: the capture's mean distance over the yardsticks' mean, its worst token over its base, and its
  worst token's largest element over that base
  damage: another sample's states (the next longer sample's first T rows), the sequence offset by one
  token, layer 14 or 16 stored as 15 (sample means), and the largest value of one token with its sign
  flipped (that token), by the distance and by the larger of the distance and the largest element.
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import shlex
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from actors.sglang.engine import SGLangEngine  # noqa: E402
from pipeline.format.shards import open_shards  # noqa: E402
from pipeline.intake.model import prepare_default_model  # noqa: E402
from pipeline.tools.audit import REFERENCE_RUNS, Reference  # noqa: E402
from pipeline.tools.fidelity import (  # noqa: E402
    FINAL_DEPTH,
    FLOOR,
    PEAK_FACTOR,
    SAMPLE_FACTOR,
    TOKEN_FACTOR,
    as_float,
    ratios,
    upstream_noise,
)

LAYERS = (2, 14, 15, 16, 27)


def captures(model_dir, prompts: dict[str, list[int]]) -> dict[str, list[np.ndarray]]:
    with SGLangEngine({"model_dir": model_dir, "aux_layers": LAYERS, "cpu": True}, 8, 600) as eng:
        res = eng.capture(list(prompts.items()))
    out = {}
    for key, r in res.items():
        if r.error:
            raise RuntimeError(f"{key}: {r.error}")
        aux, last = r.capture.bits()
        h = last.shape[1]
        out[key] = [as_float(aux[:, j * h : (j + 1) * h]) for j in range(len(LAYERS))] + [as_float(last)]
    return out


def sample_ratio(got, truth, yards) -> float:
    return ratios(got, truth, yards)[0]


def peak_ratio(got, truth, yards, upstream) -> float:
    """The worst token's largest element over its base (widened alike)."""
    return ratios(got, truth, yards, upstream)[2]


def token_ratio(got, truth, yards, upstream) -> float:
    """The worst token over its base, the base widened by the noise the token carries up from shallower layers."""
    return ratios(got, truth, yards, upstream)[1]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("output")
    ap.add_argument("--random", type=int, default=60)
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "noise_rule.json")
    args = ap.parse_args()

    model_dir = prepare_default_model()
    prompts = {f"text:{s['sample_id']}": s["input_ids"].tolist() for s in open_shards(args.output, as_torch=False)}
    rng = np.random.default_rng(11)
    prompts |= {f"random{i}": rng.integers(100, 49000, int(rng.integers(8, 300))).tolist() for i in range(args.random)}
    t0 = time.monotonic()
    got = captures(model_dir, prompts)
    with Reference(model_dir, LAYERS) as ref:
        refs = dict(zip(prompts, ref.layers(list(prompts.values()))))
    seconds = time.monotonic() - t0

    worst: dict[str, tuple[float, str]] = {}
    least: dict[str, tuple[float, str]] = {}

    def note(table, name, value, where, pick):
        if name not in table or pick(value, table[name][0]) == value:
            table[name] = (value, where)

    k15 = LAYERS.index(15)
    for key in prompts:
        truth, yards = refs[key]
        ups = upstream_noise(truth, yards, [*LAYERS, FINAL_DEPTH])
        for j, g in enumerate(got[key]):
            where = f"{key} block {j}"
            note(worst, "healthy sample", sample_ratio(g, truth[j], yards[j]), where, max)
            note(worst, "healthy token", token_ratio(g, truth[j], yards[j], ups[j]), where, max)
            note(worst, "healthy largest element", peak_ratio(g, truth[j], yards[j], ups[j]), where, max)
            shifted = np.concatenate([g[1:], g[-1:]])
            note(least, "offset by one token (sample)", sample_ratio(shifted, truth[j], yards[j]), where, min)
            bad = g.copy()
            t = len(bad) // 2
            c = int(np.argmax(np.abs(bad[t])))
            bad[t, c] = -bad[t, c]
            note(least, "one value's sign flipped (token)", token_ratio(bad, truth[j], yards[j], ups[j]), where, min)
            note(
                least,
                "one value's sign flipped (largest element)",
                peak_ratio(bad, truth[j], yards[j], ups[j]),
                where,
                min,
            )
            # The rule fails the token when either criterion does: its excess is the larger of the two.
            excess = max(
                token_ratio(bad, truth[j], yards[j], ups[j]) / TOKEN_FACTOR,
                peak_ratio(bad, truth[j], yards[j], ups[j]) / PEAK_FACTOR,
            )
            note(least, "one value's sign flipped (excess over the rule)", excess, where, min)
        for other in (LAYERS.index(14), LAYERS.index(16)):
            r = sample_ratio(got[key][other], truth[k15], yards[k15])
            note(least, "neighbouring layer (sample)", r, f"{key} layer {LAYERS[other]} as 15", min)
    by_len = sorted(prompts, key=lambda k: len(prompts[k]))
    for a, b in zip(by_len, by_len[1:]):
        n = len(prompts[a])
        truth, yards = refs[a]
        for j in range(len(LAYERS) + 1):
            r = sample_ratio(got[b][j][:n], truth[j], yards[j])
            note(least, "another sample's states (sample)", r, f"{b} as {a} block {j}", min)

    result = {
        "benchmark": "the bf16-noise rule's margins: healthy SGLang captures and damaged copies against the audit's reference",
        "machine": f"{platform.machine()}, {platform.processor() or 'cpu'}",
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d"),
        "command": shlex.join(["python", "bench/bench_noise_rule.py", *sys.argv[1:]]),
        "model": "SmolLM2-135M-Instruct (the default), SGLang CPU mode, bf16",
        "samples": {"text": len(prompts) - args.random, "random": args.random, "layers": list(LAYERS) + ["final"]},
        "reference_runs": [f"{d}, {a} attention" for d, a in REFERENCE_RUNS],
        "factors": {"sample": SAMPLE_FACTOR, "token": TOKEN_FACTOR, "peak": PEAK_FACTOR, "floor": FLOOR},
        "healthy_worst": {k: {"ratio": round(v, 3), "where": w} for k, (v, w) in worst.items()},
        "damage_least": {k: {"ratio": round(v, 2), "where": w} for k, (v, w) in least.items()},
        "seconds": round(seconds, 1),
    }
    sample_damage = min(v for k, (v, _) in least.items() if k.endswith("(sample)"))
    result["margins"] = {
        "sample factor over healthy": round(SAMPLE_FACTOR / worst["healthy sample"][0], 2),
        "sample damage over sample factor": round(sample_damage / SAMPLE_FACTOR, 2),
        "token factor over healthy": round(TOKEN_FACTOR / worst["healthy token"][0], 2),
        "token damage over token factor": round(least["one value's sign flipped (token)"][0] / TOKEN_FACTOR, 2),
        "peak factor over healthy largest element": round(PEAK_FACTOR / worst["healthy largest element"][0], 2),
        "sign flip (largest element) over peak factor": round(
            least["one value's sign flipped (largest element)"][0] / PEAK_FACTOR, 2
        ),
        "sign flip, excess over the rule (either criterion)": round(
            least["one value's sign flipped (excess over the rule)"][0], 2
        ),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps({k: result[k] for k in ("healthy_worst", "damage_least", "margins")}, indent=2))


if __name__ == "__main__":
    main()

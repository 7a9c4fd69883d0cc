"""Two outputs of the same input and settings hold the same samples: the same ids, tokens and loss masks,
and hidden states that agree (per sample and stored layer, the mean per-token cosine between the two).

  python bench/compare_outputs.py OUT_A OUT_B [--min-mean-cosine 0.9999] [--json PATH]

For a change that must not change what is stored (a refactor): run the job before and after on the same
input, then this. Batching differs from run to run, so bf16 states are not bit-identical; the share of
bit-identical values is printed beside the cosines. Exits 1 when anything differs or a cosine is below.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from pipeline import open_shards  # noqa: E402
from pipeline.format.manifest import read_manifest  # noqa: E402
from pipeline.format.storage import Store  # noqa: E402
from pipeline.tools.fidelity import as_float  # noqa: E402


def _cosines(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    a, b = as_float(a), as_float(b)
    return (a * b).sum(-1) / np.maximum(np.linalg.norm(a, axis=-1) * np.linalg.norm(b, axis=-1), 1e-30)


def compare(out_a: str, out_b: str, min_mean_cosine: float) -> dict:
    a = {s["sample_id"]: s for s in open_shards(out_a, as_torch=False)}
    b = {s["sample_id"]: s for s in open_shards(out_b, as_torch=False)}
    h = read_manifest(Store(out_a))["hidden_size"]
    problems, worst, same, total = [], (1.0, ""), 0, 0
    if set(a) != set(b):
        problems.append(f"sample ids differ: {len(set(a) - set(b))} only in A, {len(set(b) - set(a))} only in B")
    for sid in sorted(set(a) & set(b)):
        x, y = a[sid], b[sid]
        for col in ("input_ids", "loss_mask"):
            if not np.array_equal(x[col], y[col]):
                problems.append(f"{sid}: {col} differs")
        for col in ("aux_hidden_states", "last_hidden_state"):
            if x[col].shape != y[col].shape:
                problems.append(f"{sid}: {col} shape {x[col].shape} vs {y[col].shape}")
                continue
            same, total = same + int((x[col] == y[col]).sum()), total + x[col].size
            for k in range(x[col].shape[1] // h):
                m = float(_cosines(x[col][:, k * h : (k + 1) * h], y[col][:, k * h : (k + 1) * h]).mean())
                worst = min(worst, (m, f"{sid} {col} block {k}"))
                if m < min_mean_cosine:
                    problems.append(f"{sid} {col} block {k}: mean per-token cosine {m:.6f} < {min_mean_cosine}")
    return {
        "samples": len(a),
        "worst_mean_cosine": round(worst[0], 7),
        "worst_at": worst[1],
        "bit_identical_share": round(same / max(total, 1), 4),
        "problems": problems,
        "passed": not problems,
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out_a")
    ap.add_argument("out_b")
    ap.add_argument("--min-mean-cosine", type=float, default=0.9999)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    result = compare(args.out_a, args.out_b, args.min_mean_cosine)
    print(json.dumps(result, indent=2))
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    sys.exit(0 if result["passed"] else 1)


if __name__ == "__main__":
    main()

"""bf16 forwards on this CPU: torch's own bf16 products against float32 products rounded to bf16
(actors/hf/bf16_gemms.py), which the decoder uses where the CPU has no native bf16 matmul.

  python bench/probes/bench_bf16_gemms_cpu.py [--lengths 30,150,400] [--repeats 2] [--out bench/results/bf16_gemms_cpu.json]

For one product of a decoder's shape (tokens x 576 @ 576 x 1536) and for whole forwards of the default model
(hidden states, both attention kernels the audit uses): the seconds each way, the share of elements in which
the two differ, and each layer's relative L2 distance from the float32 forward. The yardstick is what a bf16
forward is used for (pipeline/tools/fidelity.py), so the distances, not bit equality, say whether the two ways
measure the same noise.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from bench_throughput import command_line, machine  # noqa: E402
from timing import best_wall_s  # noqa: E402

from actors.hf import bf16_gemms  # noqa: E402
from pipeline.intake.model import resolve_model  # noqa: E402

LAYERS = (2, 15, 27, 30)  # HF hidden_states indices: the default aux layers' outputs and the final norm's


def best_seconds(fn, repeats: int) -> float:
    return round(best_wall_s(fn, repeats), 4)  # after one uncounted call: allocations, kernel choice


def product(repeats: int, tokens: int) -> dict:
    import torch
    import torch.nn.functional as F

    g = torch.Generator().manual_seed(0)
    x, w = (torch.randn(s, generator=g).bfloat16() for s in ((tokens, 576), (1536, 576)))
    torch_own = F.linear(x, w)
    with bf16_gemms.float32_gemms():
        widened = F.linear(x, w)
        widened_s = best_seconds(lambda: F.linear(x, w), repeats * 5)
    return {
        "shape": [tokens, 576, 1536],
        "torch_bf16_s": best_seconds(lambda: F.linear(x, w), repeats * 5),
        "widened_s": widened_s,
        "float32_s": best_seconds(lambda: F.linear(x.float(), w.float()), repeats * 5),
        "elements_differing": round((torch_own != widened).float().mean().item(), 6),
    }


def hidden_states(model, ids, widen: bool = False):
    import torch

    with torch.inference_mode(), bf16_gemms.float32_gemms(widen):
        return model(ids, output_hidden_states=True).hidden_states


def distance(states, truth, i: int) -> float:
    return round(((states[i].float() - truth[i]).norm() / truth[i].norm()).item(), 5)


def forwards(lengths: list[int], repeats: int) -> list[dict]:
    import torch
    from transformers import AutoModelForCausalLM

    path = resolve_model("default")
    out = []
    for attn in ("sdpa", "eager"):
        f32, bf16 = (
            AutoModelForCausalLM.from_pretrained(path, dtype=dt, attn_implementation=attn).get_decoder().eval()
            for dt in (torch.float32, torch.bfloat16)
        )
        for n in lengths:
            ids = torch.randint(100, 30000, (1, n), generator=torch.Generator().manual_seed(n))
            truth = hidden_states(f32, ids)
            own, widened = hidden_states(bf16, ids), hidden_states(bf16, ids, True)
            row = {
                "attention": attn,
                "tokens": n,
                "torch_bf16_s": best_seconds(functools.partial(hidden_states, bf16, ids), repeats),
                "widened_s": best_seconds(functools.partial(hidden_states, bf16, ids, True), repeats),
                "float32_s": best_seconds(functools.partial(hidden_states, f32, ids), repeats),
                "distance_from_float32": {
                    f"hidden_states[{i}]": {
                        "torch_bf16": distance(own, truth, i),
                        "widened": distance(widened, truth, i),
                    }
                    for i in LAYERS
                },
            }
            print(json.dumps(row), file=sys.stderr)
            out.append(row)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lengths", default="30,150,400")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--out", type=Path, default=ROOT / "bench/results/bf16_gemms_cpu.json")
    args = ap.parse_args()
    import torch

    torch.manual_seed(0)
    lengths = [int(x) for x in args.lengths.split(",")]
    result = {
        "benchmark": "bf16 forwards on a CPU: torch's bf16 products against float32 products rounded to bf16",
        "date": datetime.date.today().isoformat(),
        "command": command_line(),
        "machine": machine(),
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "decoder_uses_widened_here": bf16_gemms.needed("cpu", "bfloat16"),
        "product": product(args.repeats, max(lengths)),
        "forwards": forwards(lengths, args.repeats),
    }
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()

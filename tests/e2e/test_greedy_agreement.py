"""Greedy regeneration through the job's SGLang engine agrees with transformers' greedy decoding of the same prompt,
token for token, up to the first position where the two best logits are within bf16 noise of each other.

Each regenerated turn is checked with one teacher-forced float32 forward of prompt + regenerated tokens: its argmax at
every position is transformers' greedy choice given the same prefix (so up to the first disagreement it is exactly
what `generate` would write). Where the choices differ, the float32 logits of the two tokens must lie within bf16
noise at that position (the engine computes in bf16 where the CPU multiplies it natively): four times the larger of
how far transformers' own bf16 forward moves their difference there and the bf16 spacing at their magnitude. A
wrong prompt, template or position would show as disagreements far outside that, and on many turns."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pyarrow as pa
import pytest

from tests_support import sample_chats

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[2]
PROMPTS = 32
NEW_TOKENS = 12


def _lines() -> list[str]:
    chats = sorted(sample_chats(), key=lambda r: len(json.dumps(r)))[: PROMPTS * 2 : 2]  # short to medium, varied
    return [json.dumps(dict(r, id=f"g{i}")) for i, r in enumerate(chats)]


def test_greedy_tokens_agree_with_transformers_up_to_a_near_tie(model_dir, tmp_path):
    import torch
    from transformers import AutoModelForCausalLM

    from actors.hf import bf16_gemms
    from actors.regenerator import Regenerator
    from actors.sglang.engine import SGLangEngine
    from conf.schema import SGLangEngineConfig
    from pipeline.format.regenerated import PROVENANCE, list_parts, read_part
    from pipeline.format.storage import Store
    from pipeline.intake.conversation import RegenerationCodec, identify_lines

    lines = _lines()
    codec = RegenerationCodec(str(model_dir), {}, "id", "last", False)
    prompts = {}
    for line in lines:
        conv = codec.parse(line)
        prompts[conv.sample_id] = codec.prompt_ids(conv, conv.targets[0])
    kwargs = SGLangEngine.generation_kwargs(SGLangEngineConfig(), str(model_dir), False, 2, PROMPTS)
    sampling = {"temperature": 0.0, "top_p": 1.0, "max_new_tokens": NEW_TOKENS, "seed": 0}
    out = tmp_path / "out"
    stage = Regenerator("sglang", kwargs, codec, sampling, str(out), {}, on_truncated="keep", record_token_ids=True)
    try:
        batch = identify_lines(pa.table({"source": [f"s:{i}" for i in range(len(lines))], "line": lines}))
        results = stage(batch).to_pylist()
    finally:
        stage.close()
    assert all(r["status"] == "ok" for r in results), [r["reason"] for r in results if r["status"] != "ok"]
    store = Store(str(out))
    generated = {
        r["id"]: r[PROVENANCE]["turns"][0]["output_ids"] for rel in list_parts(store) for r in read_part(store, rel)
    }
    assert len(generated) == len(lines)

    fp32 = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    bf16 = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).eval()
    agree = near_ties = 0
    for sid, new in generated.items():
        ids = prompts[sid] + new
        with torch.inference_mode():
            x = torch.tensor([ids])
            ref = fp32(x).logits[0, len(prompts[sid]) - 1 : -1].float()
            # The products as a native bf16 matmul computes them, where this CPU has none (actors/hf/bf16_gemms.py).
            with bf16_gemms.float32_gemms(bf16_gemms.needed("cpu", "bfloat16")):
                low = bf16(x).logits[0, len(prompts[sid]) - 1 : -1].float()
        choice = ref.argmax(-1).tolist()
        first = next((t for t, (a, b) in enumerate(zip(choice, new)) if a != b), None)
        if first is None:
            agree += 1
            continue
        hf, ours = choice[first], new[first]
        gap = float(ref[first, hf] - ref[first, ours])
        moved = abs(float(low[first, hf] - low[first, ours]) - gap)
        spacing = 2.0 ** (math.floor(math.log2(max(float(ref[first, hf].abs()), 1e-6))) - 7)
        noise = 4 * max(moved, spacing)
        assert gap <= noise, (
            f"{sid}: token {first} of {len(new)} is {ours}, transformers' greedy choice is {hf}; their float32 "
            f"logits differ by {gap:.4f}, more than the bf16 noise there ({noise:.4f})"
        )
        near_ties += 1
    # Near ties are rare: most turns agree token for token.
    assert agree >= 0.75 * len(generated), (agree, near_ties)

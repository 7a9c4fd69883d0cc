"""Which model families run on which engine and device, as far as this project has checked: the README's
support table is made from this one (tests/unit/pipeline/test_support.py keeps them equal), the family tests run
every pair marked as checked here (tests/e2e/test_families.py), and the plan reads it: a pair that cannot run
is refused before the run, a pair nobody checked says so in the plan line and the manifest.

A family is config.json's `model_type` (pipeline.intake.model.model_type: a multimodal model's text_config
names its text family).
"""

from __future__ import annotations

from dataclasses import dataclass

CHECKED_HERE = "checked here"  # a test of this repository runs it on a CPU machine and audits the output
CHECKED_GPU = "checked on the GPU machine"  # run and audited there, recorded in bench/results
NOT_CHECKED = "not checked"
CANNOT = "cannot run"  # refused before the run, with the reason


@dataclass(frozen=True)
class Entry:
    status: str
    note: str = ""
    in_suite: bool = False  # also runs in `make test` (the rest of the checked pairs: `make test-long`)


NEAR_TIES = "MoE routing; the audit allows more at tokens whose routing is a near tie that bf16 can flip"
ENGINES = ("sglang", "hf")
DEVICES = ("cpu", "cuda")
NO_EAGLE3_CAPTURE = (
    "SGLang 0.5.23's model class for it has no EAGLE-3 aux capture (no set_eagle3_layers_to_capture), so no aux "
    "layer can be dumped"
)
NO_SLIDING_WINDOW = (
    "SGLang 0.5.23's MistralForCausalLM is its Llama class, which attends over the whole sequence: a sample "
    "longer than config.json's sliding_window would be captured with attention the model never had"
)
# (family, engine) whose model class ignores config.json's sliding_window: runs only where no sample can
# be longer than the window (extract.max_tokens <= sliding_window); the family test shows the states go wrong
# past it (bench/reports/families_cpu-h200_2026-12-01.md).
FULL_ATTENTION_ONLY = {("mistral", "sglang"): NO_SLIDING_WINDOW}
GPU_RUNS = "bench/families_gpu.py on an H200, bench/results/families_h200.json"

# (family, engine, device) -> what is known. Pairs not listed are NOT_CHECKED.
SUPPORT: dict[tuple[str, str, str], Entry] = {
    ("llama", "sglang", "cpu"): Entry(CHECKED_HERE, "the default model's family (SmolLM2)"),
    ("llama", "hf", "cpu"): Entry(CHECKED_HERE),
    ("llama", "hf", "cuda"): Entry(CHECKED_GPU, GPU_RUNS),
    ("qwen3", "hf", "cuda"): Entry(CHECKED_GPU, GPU_RUNS),
    ("qwen3_moe", "hf", "cuda"): Entry(CHECKED_GPU, GPU_RUNS),
    ("gemma3_text", "hf", "cuda"): Entry(CHECKED_GPU, GPU_RUNS),
    ("deepseek_v3", "hf", "cuda"): Entry(CHECKED_GPU, GPU_RUNS),
    ("gpt_oss", "hf", "cuda"): Entry(CHECKED_GPU, GPU_RUNS + "; eager attention"),
    ("qwen3", "sglang", "cpu"): Entry(CHECKED_HERE, "QK-norm"),
    ("mistral", "sglang", "cpu"): Entry(
        CHECKED_HERE, "with sliding_window null, or extract.max_tokens <= sliding_window (its model class has none)"
    ),
    ("mistral", "hf", "cpu"): Entry(CHECKED_HERE, "sliding windows"),
    ("qwen3", "hf", "cpu"): Entry(CHECKED_HERE, "QK-norm"),
    ("qwen3_moe", "sglang", "cpu"): Entry(CHECKED_HERE, NEAR_TIES),
    ("qwen3_moe", "hf", "cpu"): Entry(CHECKED_HERE, NEAR_TIES),
    ("gemma3_text", "sglang", "cpu"): Entry(
        CHECKED_HERE, "the hook keeps the residual stream where Gemma-3's own capture keeps a layer's delta", True
    ),
    ("gemma3_text", "hf", "cpu"): Entry(CHECKED_HERE, "1 + w norms, sliding windows"),
    ("deepseek_v3", "sglang", "cpu"): Entry(
        CANNOT,
        "SGLang 0.5.23's CPU attention backend (torch_native) runs DeepSeek's MHA prefill against its MLA latent KV "
        "cache (a batched-matmul shape mismatch: kv_lora_rank + rope dim against the query's), with Kimi-K2's "
        "config keys too",
    ),
    ("deepseek_v3", "hf", "cpu"): Entry(
        CHECKED_HERE, "MLA, MoE with a dense first block (Kimi-K2's config keys)", True
    ),
    **{
        (family, "sglang", device): Entry(CANNOT, NO_EAGLE3_CAPTURE)
        for family in ("gemma", "gemma2")
        for device in DEVICES
    },
    ("gpt_oss", "sglang", "cpu"): Entry(
        CANNOT,
        "SGLang 0.5.23 runs gpt-oss only on an attention backend with sinks (triton, fa3, intel_amx, ...), "
        "none of which its CPU mode has here",
    ),
    ("gpt_oss", "hf", "cpu"): Entry(
        CHECKED_HERE, "eager attention (transformers has no sdpa path for its sinks); " + NEAR_TIES
    ),
}

FAMILY_NAMES = {
    "gemma": "Gemma",
    "gemma2": "Gemma-2",
    "llama": "Llama",
    "mistral": "Mistral",
    "qwen3": "Qwen3",
    "qwen3_moe": "Qwen3-MoE",
    "gemma3_text": "Gemma-3",
    "deepseek_v3": "DeepSeek-V3 / Kimi-K2",
    "gpt_oss": "gpt-oss",
}


class Unsupported(ValueError):
    """This family cannot run on the engine asked for; the message names the family and what runs it."""


def lookup(family: str, engine: str, device: str) -> Entry:
    return SUPPORT.get((family, engine, device), Entry(NOT_CHECKED))


def check(family: str, engine: str, device: str) -> dict:
    """What the manifest records; raises Unsupported for a pair that cannot run."""
    entry = lookup(family, engine, device)
    name = FAMILY_NAMES.get(family, family)
    if entry.status == CANNOT:
        others = [e for e in ENGINES if e != engine and lookup(family, e, device).status != CANNOT]
        known = ", ".join(f"{e} ({lookup(family, e, device).status})" for e in others)
        runs = f"; on {device} try engine.name={others[0]} ({known})" if others else ""
        raise Unsupported(f"{name} ({family}) cannot run on engine {engine} on {device}: {entry.note}{runs}")
    return {"family": family, "engine": engine, "device": device, "status": entry.status, "note": entry.note}


def check_window(family: str, engine: str, sliding_window: int | None, max_tokens: int) -> None:
    """Raises Unsupported where the engine's model class ignores a sliding window that a sample as long as
    extract.max_tokens would exceed."""
    why = FULL_ATTENTION_ONLY.get((family, engine))
    if why and sliding_window and sliding_window < max_tokens:
        name = FAMILY_NAMES.get(family, family)
        raise Unsupported(
            f"{name} ({family}) with sliding_window={sliding_window} cannot run on engine {engine} with "
            f"extract.max_tokens={max_tokens}: {why}; set extract.max_tokens <= {sliding_window} or engine.name=hf"
        )


def table_markdown() -> str:
    """The README's support table."""
    families = list(FAMILY_NAMES)
    cols = [(e, d) for e in ENGINES for d in DEVICES]
    lines = [
        "| family | " + " | ".join(f"{e} on {d}" for e, d in cols) + " |",
        "|---|" + "---|" * len(cols),
    ]
    for f in families:
        cells = []
        for e, d in cols:
            entry = lookup(f, e, d)
            cells.append(entry.status + (f": {entry.note}" if entry.note and entry.status != CHECKED_HERE else ""))
        lines.append(f"| {FAMILY_NAMES[f]} (`{f}`) | " + " | ".join(cells) + " |")
    return "\n".join(lines)

"""Tiny random-init models of the families users train EAGLE-3 drafts for, built from transformers' own config
classes with each family's quirks switched on, saved as a HF model directory with the default model's tokenizer.

    python tests/families.py FAMILY DIR     # one model directory, for trying a family by hand
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

# Small enough for a CPU run of a few prompts, big enough that every quirk is exercised: 8 layers (the default
# aux layers need 7), hidden 256, 4 query heads over 2 KV heads.
COMMON = {
    "num_hidden_layers": 8,
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-6,
}


def _configs(vocab: int, bos: int, eos: int) -> dict:
    from transformers import (
        DeepseekV3Config,
        Gemma3TextConfig,
        GptOssConfig,
        LlamaConfig,
        MistralConfig,
        Qwen3Config,
        Qwen3MoeConfig,
    )

    ids = {"vocab_size": vocab, "bos_token_id": bos, "eos_token_id": eos, "pad_token_id": eos}
    return {
        "llama": lambda: LlamaConfig(**COMMON, **ids, tie_word_embeddings=False),
        "mistral": lambda: MistralConfig(**COMMON, **ids, sliding_window=64, tie_word_embeddings=False),
        "qwen3": lambda: Qwen3Config(**COMMON, **ids, tie_word_embeddings=True),  # QK-norm
        "qwen3_moe": lambda: Qwen3MoeConfig(
            **COMMON, **ids, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=128, norm_topk_prob=True
        ),
        "gemma3_text": lambda: Gemma3TextConfig(  # 1 + w norms, sliding windows every layer but each 6th
            **COMMON, **ids, sliding_window=64, query_pre_attn_scalar=64, tie_word_embeddings=True
        ),
        "deepseek_v3": lambda: DeepseekV3Config(  # MLA, MoE, dense first block (Kimi-K2's shape)
            **{k: v for k, v in COMMON.items() if k not in ("head_dim", "num_key_value_heads")},
            **ids,
            num_key_value_heads=4,
            q_lora_rank=96,
            kv_lora_rank=64,
            qk_rope_head_dim=32,
            qk_nope_head_dim=32,
            v_head_dim=64,
            n_routed_experts=8,
            num_experts_per_tok=2,
            n_shared_experts=1,
            moe_intermediate_size=128,
            first_k_dense_replace=1,
            n_group=1,
            topk_group=1,
            tie_word_embeddings=False,
        ),
        "gpt_oss": lambda: GptOssConfig(  # MoE, attention sinks, alternating sliding windows
            **COMMON, **ids, num_local_experts=4, num_experts_per_tok=2, sliding_window=64
        ),
    }


# Keys real checkpoints ship in config.json that transformers' config class does not write (SGLang reads them).
EXTRA_CONFIG = {
    "deepseek_v3": {  # Kimi-K2's: yarn rope scaling, sigmoid routing with a correction bias, every layer MoE after the first
        "moe_layer_freq": 1,
        "scoring_func": "sigmoid",
        "topk_method": "noaux_tc",
        "routed_scaling_factor": 2.827,
        "ep_size": 1,
        "rope_scaling": {
            "type": "yarn",
            "factor": 32.0,
            "beta_fast": 1.0,
            "beta_slow": 1.0,
            "mscale": 1.0,
            "mscale_all_dim": 1.0,
            "original_max_position_embeddings": 4096,
        },
    },
}

FAMILIES = ("llama", "mistral", "qwen3", "qwen3_moe", "gemma3_text", "deepseek_v3", "gpt_oss")  # config.json model_type


def make_model(family: str, path: Path, tokenizer_dir: Path, seed: int = 0, **overrides) -> Path:
    """Write a random-init `family` model (bf16 safetensors) with the tokenizer of `tokenizer_dir` to `path`;
    `overrides`: config values set on the family's config (e.g. sliding_window=None)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    config = _configs(len(tok), tok.bos_token_id or 0, tok.eos_token_id)[family]()
    for key, value in overrides.items():
        setattr(config, key, value)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    with torch.no_grad():  # random init scaled as trained models are: residual stream grows, stays finite
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 0.02)
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path, safe_serialization=True)
    if family in EXTRA_CONFIG:
        import json

        config_file = path / "config.json"
        config_file.write_text(json.dumps({**json.loads(config_file.read_text()), **EXTRA_CONFIG[family]}, indent=2))
    for f in tokenizer_dir.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens", "vocab", "merges", "chat_template")):
            shutil.copy(f, path / f.name)
    return path


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from pipeline.intake.model import prepare_default_model

    print(make_model(sys.argv[1], Path(sys.argv[2]), prepare_default_model()))


def prompt_lines(tokenizer_dir: Path, n: int = 8) -> list[str]:
    """n pre-tokenized rows (input_ids, loss_mask on the assistant's reply) from the shipped conversations,
    tokenized once with the default tokenizer's template, so no family's template is needed."""
    import json

    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    sample = Path(__file__).resolve().parents[1] / "conf" / "data" / "sample_conversations.jsonl"
    chats = [json.loads(line) for line in sample.read_text().splitlines() if '"messages"' in line][: 4 * n : 4]
    lines = []
    for k, row in enumerate(chats[:n]):
        prompt = tok.apply_chat_template(row["messages"][:-1], add_generation_prompt=True, tokenize=True)
        full = tok.apply_chat_template(row["messages"], tokenize=True)
        prompt, full = list(getattr(prompt, "input_ids", prompt)), list(getattr(full, "input_ids", full))
        mask = [0] * len(prompt) + [1] * (len(full) - len(prompt))
        lines.append(json.dumps({"id": f"fam-{k}", "input_ids": full, "loss_mask": mask}))
    return lines

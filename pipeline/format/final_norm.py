"""The target's final norm, stored with an output whose final layer is pre-norm, and applied on read.

speculators trains on the final residual stream *before* the model's final norm; SpecForge and
Model-Optimizer read it after. A post-norm state cannot be turned back (the RMS scale is gone), so outputs
store the pre-norm state with the norm's parameters (variant, eps, weight) in every shard's metadata, and a
reader that wants the post-norm state applies the norm here: float32 math, one rounding to bf16.

The parameters come from the model's own files (config.json and the safetensors checkpoint), read without
loading the model: the job's driver needs them before any engine starts.
"""

from __future__ import annotations

import base64
import hashlib
import json
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

# How the weight scales the normalized state: Llama-style RMSNorm multiplies by w, Gemma's by (1 + w)
# (its weights are stored zero-centred). Families listed by config.json `model_type`.
ONE_PLUS_FAMILIES = frozenset({"gemma", "gemma2", "gemma3", "gemma3_text", "gemma3n", "gemma3n_text", "qwen3_next"})
# The final norm's name in the checkpoint, by the layouts transformers uses (text models, then multimodal).
NORM_NAMES = (
    "model.norm.weight",
    "model.language_model.norm.weight",
    "language_model.model.norm.weight",
    "model.text_model.norm.weight",
)
_DTYPES = {"F32": np.float32, "F16": np.float16, "BF16": np.uint16}


class FinalNormError(ValueError):
    """The model's final norm cannot be found or is not one this module can apply; the message says what to do."""


@dataclass(frozen=True, eq=False)  # eq by identity: the weight is an array
class FinalNorm:
    variant: str  # "rms" (y = w * x / rms(x)) or "rms_one_plus" (y = (1 + w) * x / rms(x))
    eps: float
    weight: np.ndarray  # float32 [H], exactly the checkpoint's values

    def __post_init__(self):
        if self.variant not in ("rms", "rms_one_plus"):
            raise FinalNormError(f"final norm variant {self.variant!r}: known are 'rms' and 'rms_one_plus'")

    @property
    def scale(self) -> np.ndarray:
        return self.weight + 1.0 if self.variant == "rms_one_plus" else self.weight

    def to_json(self) -> dict:
        raw = np.ascontiguousarray(self.weight, dtype="<f4").tobytes()
        return {
            "variant": self.variant,
            "eps": self.eps,
            "hidden_size": int(self.weight.size),
            "weight_float32_base64": base64.b64encode(raw).decode(),
            "weight_sha256": hashlib.sha256(raw).hexdigest(),
        }

    def describe(self) -> dict:
        """What the manifest says of it (the weight itself lives in each shard's metadata)."""
        d = self.to_json()
        del d["weight_float32_base64"]
        return d

    @classmethod
    def from_json(cls, d: dict) -> FinalNorm:
        raw = base64.b64decode(d["weight_float32_base64"])
        if hashlib.sha256(raw).hexdigest() != d["weight_sha256"]:
            raise FinalNormError("the stored final norm's weight does not match its sha256")
        return cls(d["variant"], float(d["eps"]), np.frombuffer(raw, dtype="<f4").astype(np.float32))

    def apply(self, x) -> np.ndarray:
        """float32 [T, H] post-norm states from pre-norm ones (bf16 bits as uint16, or floats)."""
        x = np.asarray(x)
        if x.dtype == np.uint16:
            x = (x.astype(np.uint32) << 16).view(np.float32)
        x = x.astype(np.float32, copy=False)
        if x.shape[-1] != self.weight.size:
            raise ValueError(f"states of width {x.shape[-1]}, final norm of {self.weight.size}")
        ms = np.einsum("th,th->t", x, x, dtype=np.float32) / np.float32(x.shape[-1])
        inv = (1.0 / np.sqrt(ms + np.float32(self.eps))).astype(np.float32)
        return x * inv[:, None] * self.scale[None, :].astype(np.float32)

    def apply_bits(self, bits: np.ndarray) -> np.ndarray:
        """bf16 bits (uint16 [T, H]) of the post-norm state: `apply`, rounded once to bf16 (nearest even)."""
        return to_bf16_bits(self.apply(bits))


def to_bf16_bits(x: np.ndarray) -> np.ndarray:
    """float32 -> bf16 bits, round to nearest even (finite values)."""
    u = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    return ((u + (np.uint32(0x7FFF) + ((u >> 16) & np.uint32(1)))) >> 16).astype(np.uint16)


def _text_config(config: dict) -> dict:
    return config.get("text_config") or config


def norm_variant(config: dict) -> str:
    types = {config.get("model_type"), _text_config(config).get("model_type")}
    return "rms_one_plus" if types & ONE_PLUS_FAMILIES else "rms"


def _safetensors_files(model_dir: Path, name: str) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.exists():
        where = json.loads(index.read_text()).get("weight_map", {}).get(name)
        return [model_dir / where] if where else []
    return sorted(model_dir.glob("*.safetensors"))


def _read_tensor(path: Path, name: str) -> np.ndarray | None:
    """One tensor of a safetensors file as float32, or None when the file lacks it (header parsed by hand:
    the driver reads this without torch)."""
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
        entry = header.get(name)
        if entry is None:
            return None
        if entry["dtype"] not in _DTYPES:
            raise FinalNormError(f"{path.name}: {name} is {entry['dtype']}; the final norm must be F32, F16 or BF16")
        start, end = entry["data_offsets"]
        f.seek(8 + n + start)
        raw = np.frombuffer(f.read(end - start), dtype=_DTYPES[entry["dtype"]])
    if entry["dtype"] == "BF16":
        return (raw.astype(np.uint32) << 16).view(np.float32).copy()
    return raw.astype(np.float32)


def read_final_norm(model_dir) -> FinalNorm:
    """The final norm of a local HF model directory (config.json + safetensors)."""
    model_dir = Path(model_dir)
    config = json.loads((model_dir / "config.json").read_text())
    text = _text_config(config)
    eps = text.get("rms_norm_eps", text.get("layer_norm_epsilon", text.get("norm_eps")))
    if eps is None:
        raise FinalNormError(
            f"{model_dir}: config.json names no rms_norm_eps; its final norm is not an RMSNorm this tool can "
            "apply: set extract.final_layer=post_norm"
        )
    for name in NORM_NAMES:
        for path in _safetensors_files(model_dir, name):
            weight = _read_tensor(path, name)
            if weight is not None:
                if weight.ndim != 1 or weight.size != int(text["hidden_size"]):
                    raise FinalNormError(f"{path.name}: {name} has shape {list(weight.shape)}, not [hidden_size]")
                return FinalNorm(norm_variant(config), float(eps), weight)
    raise FinalNormError(
        f"{model_dir}: no final norm weight ({', '.join(NORM_NAMES)}) in its safetensors files; "
        "set extract.final_layer=post_norm to store the norm's output instead"
    )

"""The plan of a run: the model, the shard layout, the device and the settings that change a sample's bytes.

Made before Ray starts any work; a configuration that cannot be planned raises PlanError, which preflight
reports as one line.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from conf import HarvestConfig
from pipeline.driver import support
from pipeline.format.final_norm import FinalNormError, read_final_norm
from pipeline.format.shards import ShardLayout
from pipeline.intake import model as model_lib
from pipeline.intake.tokenize import tokenizer_facts


class PlanError(ValueError):
    """The run cannot be planned as configured; the message names the setting and what to change."""


@dataclass(frozen=True)
class Plan:
    model_dir: Path
    layout: ShardLayout
    cuda: bool
    settings: dict  # everything that changes the bytes of a sample
    support: dict = field(default_factory=dict)  # what pipeline/driver/support.py knows of this family here
    # len(tokenizer): the bound for rows given as token ids (the tokenize stage then never loads the tokenizer).
    tokenizer_size: int | None = None


def default_aux_layers(num_layers: int) -> tuple[int, ...]:
    """The layers EAGLE-3 drafts read by default, in our ids (output of decoder layer i = HF hidden_states[i+1]).

    SGLang's own default (no ids given) captures the *input* of layers [2, L//2, L-3], i.e. HF
    hidden_states[2, L//2, L-3]; SpecForge's [1, L//2-1, L-4] (0-based outputs) and speculators'
    [2, L//2, L-3] (HF indices) are the same layers. Ids passed with --return-aux-hidden-state-layer-ids
    are outputs (SGLang adds one), so the same layers are outputs [1, L//2-1, L-4]. A draft trained on
    other layers than those its serving config reads without naming them is silently wrong.
    """
    return (1, num_layers // 2 - 1, num_layers - 4)


def make_plan(cfg: HarvestConfig, gpus_available: float) -> Plan:
    """Raises PlanError, whose message names the setting and what to change."""
    try:
        model_dir = model_lib.resolve_model(cfg.model.path)
    except model_lib.ModelNotFound as e:
        raise PlanError(str(e)) from None
    cuda = cfg.engine.device == "cuda" or (cfg.engine.device == "auto" and gpus_available > 0)
    try:  # first: a family this engine cannot run is refused before anything of the model is read
        family = model_lib.model_type(model_dir)
        known = support.check(family, cfg.engine.name, "cuda" if cuda else "cpu")
        support.check_window(family, cfg.engine.name, model_lib.sliding_window(model_dir), cfg.extract.max_tokens)
    except support.Unsupported as e:
        raise PlanError(str(e)) from None
    except (OSError, ValueError) as e:
        raise PlanError(f"model.path {cfg.model.path!r} cannot be used: {type(e).__name__}: {e}") from None
    try:
        n_layers, hidden = model_lib.num_hidden_layers(model_dir), model_lib.hidden_size(model_dir)
        hashes, tokenizer_size = tokenizer_facts(model_dir)
        fingerprints = {"model_sha256": model_lib.model_fingerprint(model_dir), **hashes}
    except (OSError, ValueError, KeyError) as e:
        raise PlanError(f"model.path {cfg.model.path!r} cannot be used: {type(e).__name__}: {e}") from None
    aux = cfg.extract.aux_layers or default_aux_layers(n_layers)
    if not cfg.extract.aux_layers and (len(set(aux)) != len(aux) or min(aux) < 0):
        # Only the default can (conf/schema.py refuses repeated ids): a model of fewer than 7 layers.
        raise PlanError(
            f"the default aux layers {list(aux)} do not fit a model of {n_layers} layers (they need 7 or more); "
            "set extract.aux_layers to distinct layer ids"
        )
    if max(aux) >= n_layers or min(aux) < 0:
        raise PlanError(f"extract.aux_layers {list(aux)}: the model has layers 0..{n_layers - 1}")
    final_norm = None
    if cfg.extract.final_layer == "pre_norm":
        try:
            final_norm = read_final_norm(model_dir)
        except (FinalNormError, OSError, ValueError, KeyError) as e:
            raise PlanError(f"extract.final_layer=pre_norm: {e}") from None
    layout = ShardLayout(
        tuple(aux), hidden, cfg.output.encoding, cfg.output.zstd_level, cfg.output.last_hidden_state, final_norm
    )
    settings = {
        "format_version": layout.metadata()["format_version"],
        **fingerprints,
        "aux_layers": list(aux),
        "hidden_size": layout.hidden_size,
        "max_tokens": cfg.extract.max_tokens,
        "overlength": cfg.extract.overlength,
        "encoding": cfg.output.encoding,
        "last_hidden_state_rows": cfg.output.last_hidden_state,
        "final_layer": layout.final_layer,
        **({"final_norm": final_norm.describe()} if final_norm is not None else {}),
        "id_field": cfg.input.id_field,
        "turns": cfg.extract.turns,
        "template_kwargs": dict(cfg.extract.template_kwargs),
    }
    return Plan(model_dir, layout, cuda, settings, known, tokenizer_size)

"""Per-request hidden-state dumps for SGLang 0.5.23, keyed by request id, off the forward path.

Wraps ``LogitsProcessor.forward`` (srt/layers/logits_processor.py). At its entry, for an extend (prefill)
batch, ``hidden_states`` is the final-norm output [T_batch, H] and ``aux_hidden_states`` holds the residual
stream after each layer chosen by ``--return-aux-hidden-state-layer-ids``; rows are packed in batch order and
map to requests through ``forward_batch.rids``, ``extend_seq_lens_cpu`` and ``extend_prefix_lens_cpu``.
Pruning to the last token happens later inside that function, so the entry sees every row. Everything
SGLang-specific is here; what is done with the rows is hidden_harvest_publisher.py (version-independent).

The final layer before the norm (HIDDEN_HARVEST_FINAL=pre_norm): models end their layer stack with
``layer_boundary.residual.batch.final_norm(hidden_states, forward_batch, norm, capture=None)``, whose
``capture`` callback receives the updated residual, i.e. the input of the final norm (the fused kernel
adds the last layer's output and the residual, then normalizes). The wrapper below passes a callback that
keeps a copy on the forward batch, and the LogitsProcessor wrapper dumps that copy as the final layer. A
model that never calls final_norm leaves no copy: its requests get a dump with an error, never the
post-norm state under a pre-norm label.

Gemma-3 (``models/gemma3_causal.py``, also inside Gemma-3's multimodal model) defers each layer's residual add
to the next layer's fused norm: a layer returns ``(delta, residual)`` and the residual stream after it is
their sum. Its aux capture appends only ``delta``, another quantity than any other model's, and it calls its
final norm directly. The hook wraps its decoder layer and keeps ``delta + residual`` of the captured layers
(HIDDEN_HARVEST_AUX_LAYERS, the ids given to SGLang) and of the last layer (the final norm's input) on the
forward batch; the LogitsProcessor wrapper dumps those instead.
"""

from __future__ import annotations

import importlib.metadata
import logging
import os

from hidden_harvest_imports import patch_after_import

PINNED_SGLANG_VERSION = "0.5.23"
_TARGET_MODULE = "sglang.srt.layers.logits_processor"
_NORM_MODULE = "sglang.srt.layers.layer_boundary.residual.batch"
_GEMMA3_MODULE = "sglang.srt.models.gemma3_causal"
_PRE_NORM_ATTR = "_hidden_harvest_pre_norm"  # on the ForwardBatch, set by final_norm, read by the logits hook
_AUX_ATTR = "_hidden_harvest_aux"  # {layer id: residual stream after it}, where the model's own capture is not it
FINAL_LAYER = os.environ.get("HIDDEN_HARVEST_FINAL", "post_norm")
AUX_LAYERS = [int(i) for i in os.environ.get("HIDDEN_HARVEST_AUX_LAYERS", "").split(",") if i.strip()]

logger = logging.getLogger("hidden_harvest_hook")


def _check_version() -> None:
    found = importlib.metadata.version("sglang")
    if found != PINNED_SGLANG_VERSION:
        raise RuntimeError(
            f"hidden-harvest's SGLang hook is pinned to sglang=={PINNED_SGLANG_VERSION}, found {found}; "
            "install the pinned version (make install) or port patches/sglang/ to the new version"
        )


def _tp_rank() -> int:
    # With DP attention each attention-TP group holds different requests; rank 0 of each writes.
    try:
        from sglang.srt.runtime_context import get_parallel

        par = get_parallel()
        for name in ("attn_tp_rank", "tp_rank"):
            try:
                return int(getattr(par, name))
            except (AttributeError, RuntimeError, ValueError):
                continue
    except ImportError:
        pass
    return 0


_publisher = None  # hidden_harvest_publisher.DumpPublisher, made when the target module is patched


def _capturing_graph() -> bool:
    import torch

    return torch.cuda.is_current_stream_capturing()


def _patch(module) -> None:
    global _publisher
    _check_version()
    dump_dir = os.environ["HIDDEN_HARVEST_DUMP_DIR"]
    faults = None
    if os.environ.get("HIDDEN_HARVEST_FAULTS"):  # tests only
        from hidden_harvest_faults import Faults

        faults = Faults.from_env(dump_dir)
        logger.warning("hidden-harvest: FAULT INJECTION ON (%s)", os.environ["HIDDEN_HARVEST_FAULTS"])
    from hidden_harvest_publisher import DumpPublisher

    _publisher = DumpPublisher(
        dump_dir,
        os.environ.get("HIDDEN_HARVEST_RID_PREFIX", "hh-"),
        faults,
        os.environ.get("HIDDEN_HARVEST_LAYOUT", "planes"),
    )
    cls = module.LogitsProcessor
    original = cls.forward
    if getattr(original, "_hidden_harvest", False):
        return
    from sglang.srt.model_executor.forward_batch_info import ForwardBatch

    def forward(self, input_ids, hidden_states, lm_head, logits_metadata, aux_hidden_states=None, *args, **kwargs):
        if (
            isinstance(logits_metadata, ForwardBatch)
            and aux_hidden_states is not None
            and logits_metadata.forward_mode.is_extend()
            and _tp_rank() == 0
        ):
            fb = logits_metadata
            if hidden_states.is_cuda and _capturing_graph():
                raise RuntimeError(
                    "hidden-harvest's hook is being captured into a CUDA graph: a replay would skip it and no "
                    "hidden states would be dumped; run SGLang with --disable-prefill-cuda-graph (the engine does)"
                )
            final, aux, error = hidden_states, aux_hidden_states, None
            streams = getattr(fb, _AUX_ATTR, None)
            if streams is not None:  # a model whose own aux capture is not the residual stream (Gemma-3)
                if all(i in streams for i in AUX_LAYERS):
                    aux = [streams[i] for i in AUX_LAYERS]
                else:
                    error = f"the residual stream of aux layers {AUX_LAYERS} was not kept (found {sorted(streams)})"
            if FINAL_LAYER == "pre_norm":
                final = getattr(fb, _PRE_NORM_ATTR, None)
                if final is None and error is None:
                    error = (
                        f"no pre-norm state: this model's forward does not end in {_NORM_MODULE}.final_norm "
                        "(unsupported by the SGLang 0.5.23 hook); extract with extract.final_layer=post_norm"
                    )
                if final is None:
                    final = hidden_states
            _publisher.capture(
                input_ids,
                final,
                aux,
                fb.rids,
                fb.extend_seq_lens_cpu,
                fb.extend_prefix_lens_cpu,
                final_layer=FINAL_LAYER,
                error=error,
            )
        return original(self, input_ids, hidden_states, lm_head, logits_metadata, aux_hidden_states, *args, **kwargs)

    forward._hidden_harvest = True
    cls.forward = forward
    logger.info(
        "hidden-harvest hook installed on %s.LogitsProcessor.forward, dumping to %s",
        _TARGET_MODULE,
        _publisher.dump_dir,
    )


def _patch_final_norm(module) -> None:
    _check_version()
    original = module.final_norm
    if getattr(original, "_hidden_harvest", False):
        return
    from sglang.srt.model_executor.forward_batch_info import ForwardBatch

    def final_norm(hidden_states, forward_batch, layernorm, capture=None, **kwargs):
        if not (isinstance(forward_batch, ForwardBatch) and forward_batch.forward_mode.is_extend()):
            return original(hidden_states, forward_batch, layernorm, capture, **kwargs)

        def keep(residual):
            # The residual's storage is borrowed (final_norm's contract): keep a copy until the logits hook.
            setattr(forward_batch, _PRE_NORM_ATTR, residual.clone())
            if capture is not None:
                capture(residual)

        return original(hidden_states, forward_batch, layernorm, keep, **kwargs)

    final_norm._hidden_harvest = True
    module.final_norm = final_norm
    logger.info("hidden-harvest: final layer captured before the final norm (%s.final_norm)", _NORM_MODULE)


def _patch_gemma3(module) -> None:
    _check_version()
    layer_cls, model_cls = module.Gemma3DecoderLayer, module.Gemma3TextModel
    if getattr(layer_cls.forward, "_hidden_harvest", False):
        return
    from sglang.srt.model_executor.forward_batch_info import ForwardBatch

    original_layer, original_model = layer_cls.forward, model_cls.forward

    def model_forward(self, *args, **kwargs):
        if not getattr(self, "_hidden_harvest_indexed", False):  # the layer knows its place only through this
            for i, layer in enumerate(self.layers):
                layer._hidden_harvest_index, layer._hidden_harvest_last = i, i == len(self.layers) - 1
            self._hidden_harvest_indexed = True
        return original_model(self, *args, **kwargs)

    def layer_forward(self, *args, **kwargs):
        delta, residual = original_layer(self, *args, **kwargs)
        fb = kwargs.get("forward_batch")
        i = getattr(self, "_hidden_harvest_index", None)
        if isinstance(fb, ForwardBatch) and fb.forward_mode.is_extend() and i is not None:
            last = FINAL_LAYER == "pre_norm" and self._hidden_harvest_last
            if i in AUX_LAYERS or last:
                stream = delta + residual  # what the next layer's fused norm adds: the residual stream after i
                if i in AUX_LAYERS:
                    if getattr(fb, _AUX_ATTR, None) is None:
                        setattr(fb, _AUX_ATTR, {})
                    getattr(fb, _AUX_ATTR)[i] = stream
                if last:
                    setattr(fb, _PRE_NORM_ATTR, stream)
        return delta, residual

    layer_forward._hidden_harvest = True
    model_cls.forward, layer_cls.forward = model_forward, layer_forward
    logger.info("hidden-harvest: Gemma-3's residual stream kept at layers %s (%s)", AUX_LAYERS, _GEMMA3_MODULE)


def install_import_hook() -> None:
    patch_after_import(_TARGET_MODULE, _patch)
    patch_after_import(_GEMMA3_MODULE, _patch_gemma3)
    if FINAL_LAYER == "pre_norm":
        patch_after_import(_NORM_MODULE, _patch_final_norm)
    elif FINAL_LAYER != "post_norm":
        raise RuntimeError(f"HIDDEN_HARVEST_FINAL={FINAL_LAYER!r}: pre_norm or post_norm")

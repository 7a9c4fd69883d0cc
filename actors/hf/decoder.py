"""The target's decoder in transformers, without its LM head, with hooks that keep what one forward stores.

Aux layer i = output of decoder layer i = HF `hidden_states[i+1]`; the final state = the output of the
final norm (post_norm), or its input, the last decoder layer's output (pre_norm): the SGLang path's two
conventions. The LM head never runs: SGLang computes logits for one
position only, and the stored states do not need them. Used by the capturing engine (engine.py) and by
the float reference (reference.py).

With `routes=True` (the reference) it also keeps, for every MoE layer, the scores its router chooses the
experts by, and with `flips=True` how far the layer's expert output moves when a token's last chosen expert
is swapped for the next one (the same weight): the audit needs both to know at which tokens the choice is a
near tie that bf16 rounding may flip, and how much a flip there may move the token
(pipeline/tools/fidelity.py, "routing").
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time

import numpy as np

from actors.hf import bf16_gemms, packing

logger = logging.getLogger(__name__)

_unpacked = threading.local()  # set while one of these forwards runs: its rows are never packed sequences


def _skip_packed_check() -> None:
    """Lets these forwards skip transformers' packed-sequence check, which waits for the device.

    Without an attention mask, transformers looks for several sequences packed into one row (positions that
    restart) and reads the answer back from the device: every forward then waits until the device has run
    everything before it, and the device idles while the host prepares the next one. These rows are single
    sequences whose positions run 0..T-1, for which the check returns None, so the answer is known without
    asking. Only forwards run here (a thread-local flag) take the shortcut; any other caller in the process
    gets the original function. (patches/README.md, "The hf engine and transformers".)"""
    from transformers import masking_utils

    original = getattr(masking_utils, "find_packed_sequence_indices", None)
    if original is None:
        logger.info("transformers has no find_packed_sequence_indices: forwards run as the library runs them")
        return
    if getattr(original, "_single_sequence_rows", False):
        return

    def find_packed_sequence_indices(position_ids):
        return None if getattr(_unpacked, "active", False) else original(position_ids)

    find_packed_sequence_indices._single_sequence_rows = True
    masking_utils.find_packed_sequence_indices = find_packed_sequence_indices


# Where torch's scaled-dot-product attention may use cuDNN's kernel on CUDA (its default pick on recent GPUs):
# "always" leaves the choice to torch; "warm" keeps it from a new forward shape whose attention is light.
# cuDNN builds an execution plan for every new shape (batch, length) on the launching thread, and a job's
# forwards almost never repeat a shape, so every forward of a job paid for one in its first layer
# (bench/results/first_layer_h100.json). The flash kernel needs no plan but runs slower, by an amount that grows
# with the attention's work, rows x length^2: it won on short rows and lost on long ones
# (bench/results/benchmix_cudnn_warm_h100.json, longtail_cudnn_warm_h100.json). So a new shape runs flash while
# its work is at most a full 16k-token forward of 2,048-token rows; a heavier one, and a shape that comes back
# (it recurs), get cuDNN's kernel.
CUDNN_ATTENTION = ("always", "warm")
FLASH_NEW_SHAPE_WORK = 16384 * 2048  # rows x length^2 of a new shape's forward, most for the flash kernel


def _first(output):
    return output[0] if isinstance(output, (tuple, list)) else output


def _router(layer):
    """(router, experts) of one decoder layer's MoE block, (None, None) for a dense layer. transformers 5's
    routers (Qwen3-MoE, gpt-oss, DeepSeek-V3/Kimi, Mixtral, GLM-4-MoE, ...) are modules with `top_k` and an
    [E, H] `weight` that return (router_logits, weights, indices); their block keeps the experts beside them
    as `experts`, called as experts(hidden [N, H], indices [N, k], weights [N, k])."""
    for name, module in layer.named_modules():
        w = getattr(module, "weight", None)
        if "router" in type(module).__name__.lower() and hasattr(module, "top_k") and getattr(w, "ndim", 0) == 2:
            block = layer.get_submodule(name.rpartition(".")[0]) if "." in name else layer
            return module, getattr(block, "experts", None)
    return None, None


def _choice_scores(router, output):
    """What the router takes its top-k over, [N, E] float32: the logits (softmax keeps their order), or for
    DeepSeek's sigmoid routing sigmoid(logits) plus the load-balancing correction bias. Group-limited routing
    (n_group > 1) first drops whole groups; the per-expert scores still say where a choice is a near tie."""
    logits = _first(output).float()
    bias = getattr(router, "e_score_correction_bias", None)
    return logits.sigmoid() + bias.float() if bias is not None else logits


class Decoder:
    def __init__(
        self,
        model_dir: str,
        aux_layers: tuple[int, ...],
        device: str,
        dtype: str,
        attn_implementation: str = "sdpa",
        final_layer: str = "post_norm",
        routes: bool = False,
        flips: bool = False,
        cudnn_attention: str = "always",
    ):
        if final_layer not in ("post_norm", "pre_norm"):
            raise ValueError(f"final_layer {final_layer!r}: post_norm or pre_norm")
        if cudnn_attention not in CUDNN_ATTENTION:
            raise ValueError(f"cudnn_attention {cudnn_attention!r}: one of {', '.join(CUDNN_ATTENTION)}")
        self.cudnn_attention = cudnn_attention
        self._shapes_run: set[tuple[int, ...]] = set()  # forward shapes run before ("warm")
        self.final_layer = final_layer
        self.model_dir = str(model_dir)
        self.aux_layers = tuple(aux_layers)
        self.device = device
        self.dtype = dtype
        self.attn_implementation = attn_implementation
        self._taken: dict = {}
        self._keeping = False
        self._hooks: list = []
        self.routes = routes or flips
        self.flips = flips
        self.routers: dict[int, int] = {}  # decoder layer -> its router's top-k (MoE layers only)
        self.load_parts: dict[str, float] = {}  # load()'s seconds by part
        # bf16 on a CPU without native bf16 matmul: products in float32, rounded to bf16 (bf16_gemms.py).
        self.float32_gemms = bf16_gemms.needed(device, dtype)

    def load(self) -> Decoder:
        t0 = time.monotonic()
        import torch
        from transformers import AutoModelForCausalLM

        imported = time.monotonic()
        _skip_packed_check()
        try:
            model = AutoModelForCausalLM.from_pretrained(
                self.model_dir, dtype=getattr(torch, self.dtype), attn_implementation=self.attn_implementation
            )
        except ValueError as e:
            # A family without this attention kernel (gpt-oss's sinks have no sdpa path): eager attention is
            # every family's reference implementation, slower but the same function.
            if self.attn_implementation == "eager" or "attention implementation" not in str(e):
                raise
            logger.warning("%s: %s; using eager attention", self.model_dir, str(e).splitlines()[0])
            self.attn_implementation = "eager"
            model = AutoModelForCausalLM.from_pretrained(
                self.model_dir, dtype=getattr(torch, self.dtype), attn_implementation="eager"
            )
        read = time.monotonic()
        if self.float32_gemms:
            logger.info("%s: bf16 products run in float32, rounded to bf16 (no native bf16 matmul)", self.model_dir)
        self.base = model.get_decoder().to(self.device).eval()
        # Where the load went, for the start-up line: the import (transformers' modeling code, the first time in
        # a process; torch is in by then), reading the model into host memory, and moving the decoder to the
        # device (on CUDA that includes the process's first CUDA call, so its context).
        self.load_parts = {
            "import": round(imported - t0, 3),
            "read": round(read - imported, 3),
            "to device": round(time.monotonic() - read, 3),
        }
        self.vocab_size = int(model.config.vocab_size)
        del model  # the LM head is never used
        self.layers = getattr(self.base, "layers", None)
        self.norm = getattr(self.base, "norm", None)
        if self.layers is None or self.norm is None:
            raise RuntimeError(
                f"{self.model_dir}: the hf engine needs a decoder with `.layers` and `.norm` (got {type(self.base).__name__})"
            )
        if self.aux_layers and max(self.aux_layers) >= len(self.layers):
            raise ValueError(f"aux layers {list(self.aux_layers)}: the model has layers 0..{len(self.layers) - 1}")
        self._hooks = [
            self.layers[i].register_forward_hook(self._keep(("aux", k))) for k, i in enumerate(self.aux_layers)
        ]
        self._hooks.append(self.norm.register_forward_hook(self._keep(("last", 0), self.final_layer == "pre_norm")))
        if self.routes:
            for i, layer in enumerate(self.layers):
                router, experts = _router(layer)
                if router is None:
                    continue
                self.routers[i] = int(router.top_k)
                self._hooks.append(router.register_forward_hook(self._keep_route(i, router)))
                if self.flips:
                    if experts is None:
                        raise RuntimeError(f"{self.model_dir}: layer {i} has a router but no `experts` beside it")
                    self._hooks.append(experts.register_forward_hook(self._keep_flip(i, experts)))
        return self

    def close(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks = []
        self._taken.clear()

    def _keep(self, slot, take_input: bool = False):
        def hook(_module, inputs, output):
            if self._keeping:
                self._taken[slot] = inputs[0] if take_input else _first(output)

        return hook

    def _keep_route(self, layer: int, router):
        def hook(_module, _inputs, output):
            if self._keeping:
                self._taken[("route", layer)] = _choice_scores(router, output)

        return hook

    def _keep_flip(self, layer: int, experts):
        import torch

        def hook(_module, inputs, output):
            if not self._keeping:
                return
            hidden, index, weights = inputs[:3]
            scores = self._taken[("route", layer)]  # the router runs before its experts
            k = index.shape[-1]
            ranked = scores.argsort(dim=-1, descending=True)
            last, runner_up = ranked[:, k - 1 : k], ranked[:, k : k + 1]
            swapped = torch.where(index == last.to(index.dtype), runner_up.to(index.dtype), index)
            delta = (experts.forward(hidden, swapped, weights) - output).float().reshape(index.shape[0], -1)
            self._taken[("flip", layer)] = (delta.norm(dim=-1), delta.abs().amax(dim=-1))

        return hook

    def pack(self) -> str | None:
        """Lets forward(packed=True) run; returns why it cannot for this model (and then changes nothing).

        The model's attention becomes packing.PACKED, which outside a packed forward is the library's sdpa
        function: padded forwards run as they would without it."""
        if self.attn_implementation != "sdpa":
            return f"attention {self.attn_implementation!r}, not sdpa"
        why = packing.refusal(self.base.config)
        if why is None:
            packing.register()
            self.base.set_attn_implementation(packing.PACKED)
        return why

    def forward(self, sequences: list[list[int]], keep: bool, pin: bool = False, packed: bool = False) -> np.ndarray:
        """One forward; returns the ids it ran: [B, T] right-padded to the first (the longest) sequence, or
        with `packed` (after pack()) [1, N], the sequences end to end (actors/hf/packing.py).

        Padded, without an attention mask: under causal attention a real token only sees earlier positions,
        which are all real, so its states are exactly those of the unpadded sequence. `keep`: the hooked
        outputs wait in `outputs()`. `pin`: the ids go up from pinned memory, so the copy queues behind the
        device's earlier work instead of waiting for it to go idle."""
        import torch

        if packed:
            ids = np.concatenate([np.asarray(s, dtype=np.int64) for s in sequences])[None, :]
            positions = np.concatenate([np.arange(len(s), dtype=np.int64) for s in sequences])[None, :]
            spans = packing.Spans.of([len(s) for s in sequences], self.device)
        else:
            ids = np.zeros((len(sequences), len(sequences[0])), dtype=np.int64)
            for row, seq in enumerate(sequences):
                ids[row, : len(seq)] = seq
            positions, spans = None, None
        self._keeping = keep
        _unpacked.active = True
        try:
            with (
                torch.inference_mode(),
                packing.active(spans) if packed else contextlib.nullcontext(),
                self._attention(ids.shape),
                bf16_gemms.float32_gemms(self.float32_gemms),
            ):
                tensors = [torch.from_numpy(a) for a in (ids, positions) if a is not None]
                if pin:
                    tensors = [t.pin_memory() for t in tensors]
                tensors = [t.to(self.device, non_blocking=True) for t in tensors]
                position_ids = tensors[1] if packed else None
                self.base(input_ids=tensors[0], position_ids=position_ids, use_cache=False)
        finally:
            self._keeping = False
            _unpacked.active = False
        return ids

    def _attention(self, shape: tuple[int, ...]):
        """The attention kernels this forward may use (CUDNN_ATTENTION). The choice is process-wide in torch
        (`sdpa_kernel` sets global flags until it exits): one forward thread per process runs these."""
        if self.cudnn_attention == "always" or not str(self.device).startswith("cuda"):
            return contextlib.nullcontext()
        seen = shape in self._shapes_run
        self._shapes_run.add(shape)
        rows, length = shape
        if seen or rows * length * length > FLASH_NEW_SHAPE_WORK:
            return contextlib.nullcontext()
        from torch.nn.attention import SDPBackend, sdpa_kernel

        return sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH])

    def outputs(self) -> tuple[list, object]:
        """The last kept forward's aux layer outputs [B, T, H] each and final-norm output [B, T, H] (device tensors)."""
        aux = [self._taken.pop(("aux", k)) for k in range(len(self.aux_layers))]
        last = self._taken.pop(("last", 0))
        self._taken.clear()
        return aux, last

    def route_scores(self, batch: int, length: int) -> dict[int, object]:
        """The last kept forward's router scores per MoE layer, [B, T, E] float32 (device tensors); empty
        unless built with routes=True."""
        return {i: self._taken.pop(("route", i)).reshape(batch, length, -1) for i in self.routers}

    def flip_sizes(self, batch: int, length: int) -> dict[int, tuple]:
        """The last kept forward's flip sizes per MoE layer: (L2 norm, largest element) of the change in the
        layer's expert output when each token's last chosen expert is swapped for the runner-up, [B, T]
        float32 each (device tensors); empty unless built with flips=True. Call before route_scores."""
        if not self.flips:
            return {}
        return {i: tuple(x.reshape(batch, length) for x in self._taken.pop(("flip", i))) for i in self.routers}

    def discard(self) -> None:
        self._taken.clear()

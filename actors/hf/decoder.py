"""The target's decoder in transformers, without its LM head, with hooks that keep what one forward stores.

Aux layer i = output of decoder layer i = HF `hidden_states[i+1]`; the final state = the output of the
final norm (post_norm), or its input, the last decoder layer's output (pre_norm): the SGLang path's two
conventions. The LM head never runs: SGLang computes logits for one
position only, and the stored states do not need them. Used by the capturing engine (engine.py) and by
the float reference (reference.py).
"""

from __future__ import annotations

import logging
import threading

import numpy as np

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


def _first(output):
    return output[0] if isinstance(output, (tuple, list)) else output


class Decoder:
    def __init__(
        self,
        model_dir: str,
        aux_layers: tuple[int, ...],
        device: str,
        dtype: str,
        attn_implementation: str = "sdpa",
        final_layer: str = "post_norm",
    ):
        if final_layer not in ("post_norm", "pre_norm"):
            raise ValueError(f"final_layer {final_layer!r}: post_norm or pre_norm")
        self.final_layer = final_layer
        self.model_dir = str(model_dir)
        self.aux_layers = tuple(aux_layers)
        self.device = device
        self.dtype = dtype
        self.attn_implementation = attn_implementation
        self._taken: dict = {}
        self._keeping = False
        self._hooks: list = []

    def load(self) -> Decoder:
        import torch
        from transformers import AutoModelForCausalLM

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
        self.base = model.get_decoder().to(self.device).eval()
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

    def forward(self, sequences: list[list[int]], keep: bool, pin: bool = False) -> np.ndarray:
        """One forward of the sequences right-padded to the first (the longest); returns the padded ids.

        Without an attention mask: under causal attention a real token only sees earlier positions, which
        are all real, so its states are exactly those of the unpadded sequence. `keep`: the hooked outputs
        wait in `outputs()`. `pin`: the ids go up from pinned memory, so the copy queues behind the device's
        earlier work instead of waiting for it to go idle."""
        import torch

        ids = np.zeros((len(sequences), len(sequences[0])), dtype=np.int64)
        for row, seq in enumerate(sequences):
            ids[row, : len(seq)] = seq
        self._keeping = keep
        _unpacked.active = True
        try:
            with torch.inference_mode():
                host_ids = torch.from_numpy(ids)
                if pin:
                    host_ids = host_ids.pin_memory()
                self.base(input_ids=host_ids.to(self.device, non_blocking=True), use_cache=False)
        finally:
            self._keeping = False
            _unpacked.active = False
        return ids

    def outputs(self) -> tuple[list, object]:
        """The last kept forward's aux layer outputs [B, T, H] each and final-norm output [B, T, H] (device tensors)."""
        aux = [self._taken.pop(("aux", k)) for k in range(len(self.aux_layers))]
        last = self._taken.pop(("last", 0))
        self._taken.clear()
        return aux, last

    def discard(self) -> None:
        self._taken.clear()

"""Per-sample checks inside the actor: a capture becomes data only if every check holds.

The hook counts non-finite values on the device and the server hashes the input ids it saw, so every
check here reads the dump's header and shapes, never the hidden-state bytes.
"""

from __future__ import annotations

import hashlib

import numpy as np

from actors.dump import Capture


def ids_sha256(input_ids) -> str:
    return hashlib.sha256(np.asarray(input_ids, dtype=np.int32).tobytes()).hexdigest()


def check_capture(
    cap: Capture,
    input_ids: list[int],
    aux_width: int,
    hidden_size: int,
    final_layer: str | None = None,
    layout: str | None = None,
) -> str | None:
    """None when the capture is the hidden states of exactly these input ids (and its final layer the
    `final_layer` convention, its body the `layout` the output encodes from, when given); else the reason."""
    n = len(input_ids)
    h = cap.header
    if h.error:
        return f"capture failed in the server: {h.error}"
    if h.prefix_len != 0:
        return f"server reused {h.prefix_len} cached prefix tokens; the capture would be truncated"
    if h.num_tokens != n:
        return f"token count mismatch: sent {n} tokens, server captured {h.num_tokens}"
    if h.ids_sha256 != ids_sha256(input_ids):
        return "input ids seen by the server differ from those sent (hash mismatch)"
    if tuple(h.aux_shape) != (n, aux_width):
        return f"aux_hidden_states shape {tuple(h.aux_shape)} != expected {(n, aux_width)}"
    if tuple(h.last_shape) != (n, hidden_size):
        return f"last_hidden_state shape {tuple(h.last_shape)} != expected {(n, hidden_size)}"
    if layout is not None and h.layout != layout:
        # An fp8 output never stores bf16 planes under its name, nor the reverse (a hook that ignored it).
        return f"the capture's layout is {h.layout}, the output encodes from {layout}"
    if final_layer is not None and h.final_layer != final_layer:
        # Never store one convention under the other's name (a hook that ignored what it was asked).
        return f"the capture's final layer is {h.final_layer}, the output stores {final_layer}"
    if h.nonfinite:
        return f"{h.nonfinite} non-finite hidden-state values"
    return None

"""Per-sample checks inside the actor: a capture becomes data only if every check holds."""

from __future__ import annotations

import hashlib

import numpy as np

from actors.dump import Capture

# bf16: exponent bits all ones means inf or NaN.
_EXP_MASK = np.uint16(0x7F80)


def ids_sha256(input_ids) -> str:
    return hashlib.sha256(np.asarray(input_ids, dtype=np.int32).tobytes()).hexdigest()


def count_nonfinite(bits: np.ndarray) -> int:
    return int(np.count_nonzero((bits & _EXP_MASK) == _EXP_MASK))


def check_capture(cap: Capture, input_ids: list[int], aux_width: int, hidden_size: int) -> str | None:
    """None when the capture is the hidden states of exactly these input ids; else the reason."""
    n = len(input_ids)
    h = cap.header
    if h.get("prefix_len", 0) != 0:
        return f"server reused {h['prefix_len']} cached prefix tokens; the capture would be truncated"
    if h["num_tokens"] != n:
        return f"token count mismatch: sent {n} tokens, server captured {h['num_tokens']}"
    if h["ids_sha256"] != ids_sha256(input_ids):
        return "input ids seen by the server differ from those sent (hash mismatch)"
    if cap.aux.shape != (n, aux_width):
        return f"aux_hidden_states shape {tuple(cap.aux.shape)} != expected {(n, aux_width)}"
    if cap.last.shape != (n, hidden_size):
        return f"last_hidden_state shape {tuple(cap.last.shape)} != expected {(n, hidden_size)}"
    bad = count_nonfinite(cap.aux) + count_nonfinite(cap.last)
    if bad:
        return f"{bad} non-finite hidden-state values"
    return None

"""A draft's vocabulary: the N target tokens it predicts, chosen by loss-masked frequency, as each trainer reads it.

EAGLE-3 drafts usually predict a subset of the target's vocabulary. The trainers name it with two arrays:
  d2t  int64 [N]: target id of draft index j = j + d2t[j] (an offset, so an identity prefix stores zeros)
  t2d  bool  [V]: whether target id t is in the draft vocabulary
Selection (speculators' `build_vocab_mappings_from_distribution`, SpecForge's `process_token_dict_to_mappings`): the
N most frequent tokens over trained (loss-masked) positions, ties by the lower id; when fewer than N distinct
tokens were trained on, the lowest unused ids fill the rest; the chosen ids sorted ascending. SpecForge breaks
ties by the order tokens were first counted, which depends on its data order; the lower id is the one order
every reader of the same counts agrees on.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import numpy as np

from pipeline.intake.model import vocab_size


class DraftVocabError(ValueError):
    """A draft vocabulary that cannot be made as asked."""


def select_vocab(freq: Counter | dict, draft_vocab: int, target_vocab: int) -> tuple[np.ndarray, np.ndarray]:
    """(d2t int64 [draft_vocab], t2d bool [target_vocab]) from token counts."""
    if draft_vocab <= 0:
        raise DraftVocabError(f"--draft-vocab {draft_vocab}: a positive number of tokens")
    if draft_vocab > target_vocab:
        raise DraftVocabError(f"--draft-vocab {draft_vocab} is larger than the target's vocabulary ({target_vocab})")
    outside = [t for t in freq if not 0 <= int(t) < target_vocab]
    if outside:
        raise DraftVocabError(f"token ids {sorted(outside)[:5]} are outside the target's vocabulary of {target_vocab}")
    ranked = sorted(freq, key=lambda t: (-freq[t], int(t)))[:draft_vocab]
    chosen = {int(t) for t in ranked}
    filler = (t for t in range(target_vocab) if t not in chosen)
    while len(chosen) < draft_vocab:
        chosen.add(next(filler))
    ids = np.array(sorted(chosen), dtype=np.int64)
    t2d = np.zeros(target_vocab, dtype=bool)
    t2d[ids] = True
    return ids - np.arange(draft_vocab, dtype=np.int64), t2d


def check_vocab(d2t: np.ndarray, t2d: np.ndarray, draft_vocab: int, target_vocab: int) -> list[str]:
    """What is wrong with a mapping read back (empty when it is whole and consistent)."""
    problems = []
    if d2t.shape != (draft_vocab,) or t2d.shape != (target_vocab,):
        return [f"shapes d2t {d2t.shape}, t2d {t2d.shape}; expected ({draft_vocab},), ({target_vocab},)"]
    ids = d2t.astype(np.int64) + np.arange(draft_vocab)
    if not np.array_equal(ids, np.flatnonzero(t2d)):
        problems.append("d2t and t2d name different tokens")
    return problems


def target_vocab_size(manifest: dict, override: int | None = None) -> int:
    """The target's vocabulary: given, else from the manifest, else from the model's config.json."""
    if override is not None:
        return int(override)
    model = manifest.get("model") or {}
    if model.get("vocab_size"):
        return int(model["vocab_size"])
    model_dir = Path(model.get("path", ""))
    if (model_dir / "config.json").is_file() and (value := vocab_size(model_dir)):
        return value
    raise DraftVocabError(
        "the output's manifest does not say the target's vocabulary size and its model directory is not here: "
        "pass --target-vocab N (the rows of the target's lm_head)"
    )

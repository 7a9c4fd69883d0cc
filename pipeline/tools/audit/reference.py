"""The audit's reference: the float32 truth and the bf16 yardsticks of the same tokens, from transformers
(actors/hf/reference.py), sharing no code with the SGLang capture path (server, hook, dump, validation)."""

from __future__ import annotations

import numpy as np

from actors.hf.reference import ReferenceStates
from pipeline.tools.fidelity import flipped_routes, near_tie_routes

# The truth, then the yardsticks: bf16 forwards of the same tokens with two attention kernels, whose
# rounding differs (pipeline/tools/fidelity.py says why two).
REFERENCE_RUNS = (("float32", "sdpa"), ("bfloat16", "sdpa"), ("bfloat16", "eager"))


class Reference:
    """The float32 truth and the bf16 yardsticks of the same tokens, from transformers (actors/hf/reference.py).

    It shares no code with the SGLang capture path (server, hook, dump, validation). `layers()` gives, per
    sequence, the K aux blocks then the final state, each [T, H] float32 numpy: the truth's, and for each
    block a tuple of the yardsticks'. `samples()` adds, for a MoE model, the tokens whose expert choice at
    each MoE layer is a near tie that bf16 may flip (fidelity.near_tie_routes)."""

    def __init__(
        self,
        model_dir,
        aux_layers,
        device: str = "cpu",
        max_batch_tokens: int | None = None,
        final_layer: str = "post_norm",
    ):
        # On a CPU padding costs as much as real tokens and batching gains little, so small batches pad less
        # and finish sooner; a GPU wants large ones.
        batch_tokens = max_batch_tokens or (16384 if device.startswith("cuda") else 2048)
        self.aux_layers = tuple(aux_layers)
        self._runs = [
            ReferenceStates(
                str(model_dir),
                self.aux_layers,
                device,
                dtype,
                batch_tokens,
                attn_implementation=attn,
                final_layer=final_layer,
                routes=True,
                flips=dtype == "float32",  # the truth measures what a routing flip moves (fidelity.py)
            )
            for dtype, attn in REFERENCE_RUNS
        ]

    def __enter__(self) -> Reference:
        try:
            for r in self._runs:
                r.start()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        for r in self._runs:
            r.close()

    @property
    def routers(self) -> dict[int, int]:
        """MoE layer -> its router's top-k, as found in the model (empty for a dense one)."""
        return self._runs[0].routers

    def layers(self, sequences: list[list[int]]) -> list[tuple[list[np.ndarray], list[tuple[np.ndarray, ...]]]]:
        """[(truth blocks, yardstick blocks)] per sequence, in order."""
        return [(truth, yards) for truth, yards, _ in self.samples(sequences)]

    def samples(self, sequences: list[list[int]]) -> list[tuple[list, list, dict[int, tuple]]]:
        """[(truth blocks, yardstick blocks, {MoE layer: ([T] bool the routing a near tie, what a flip moves
        the token: L2 norm [T], largest element [T], per yardstick [T] bool where its routing flipped)})] per
        sequence (fidelity.near_tie_tokens)."""
        k = len(self.aux_layers)
        truth, *yards = (r.states_and_routes(sequences) for r in self._runs)
        top_k = self.routers
        out = []
        for t, *ys in zip(truth, *yards):
            ties = {}
            for i in top_k:
                scores, yard_scores = t[2][i].numpy(), [y[2][i].numpy() for y in ys]
                near = near_tie_routes(scores, yard_scores, top_k[i])
                ties[i] = (near, *(x.numpy() for x in t[3][i]), flipped_routes(scores, yard_scores, top_k[i]))
            out.append((_blocks(t, k), list(zip(*(_blocks(y, k) for y in ys))), ties))
        return out


def _blocks(state, k: int) -> list[np.ndarray]:
    aux, last = state[:2]
    h = last.shape[-1]
    return [aux[:, j * h : (j + 1) * h].numpy() for j in range(k)] + [last.numpy()]

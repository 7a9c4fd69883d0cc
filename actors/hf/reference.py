"""Float hidden states of whole sequences from transformers, on the caller's thread: no capture format,
no worker threads. `harvest audit` runs it in float32 (the truth) and in bfloat16 (the noise yardstick,
pipeline/tools/fidelity.py); it shares the decoder and the batching with the capturing engine, and nothing
with the SGLang path."""

from __future__ import annotations

from dataclasses import dataclass, field

from actors.hf.batching import BatchPolicy, take_batch
from actors.hf.decoder import Decoder

_DTYPES = ("bfloat16", "float32")


@dataclass
class _Sequence:
    index: int
    ids: list[int]
    order: float = 0.0
    kept: list = field(default_factory=list)


class ReferenceStates:
    def __init__(
        self,
        model_dir,
        aux_layers: tuple[int, ...],
        device: str = "cpu",
        dtype: str = "float32",
        max_batch_tokens: int = 2048,
        cpu_threads: int | None = None,
        attn_implementation: str = "sdpa",
        final_layer: str = "post_norm",
        routes: bool = False,
        flips: bool = False,
    ):
        if dtype not in _DTYPES:
            raise ValueError(f"dtype must be one of {_DTYPES}, got {dtype!r}")
        self.decoder = Decoder(
            str(model_dir), tuple(aux_layers), device, dtype, attn_implementation, final_layer, routes, flips
        )
        self.policy = BatchPolicy(max_batch_tokens)
        self.cpu_threads = cpu_threads
        self.batches = 0

    def start(self) -> ReferenceStates:
        import torch

        if self.decoder.device == "cpu" and self.cpu_threads:
            torch.set_num_threads(self.cpu_threads)
        self.decoder.load()
        return self

    def close(self) -> None:
        self.decoder.close()

    def __enter__(self) -> ReferenceStates:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()

    @property
    def routers(self) -> dict[int, int]:
        """MoE layer -> its router's top-k (built with routes=True; empty for a dense model)."""
        return self.decoder.routers

    def states(self, sequences: list[list[int]]) -> list:
        """(aux [T, K*H], last [T, H]) float32 CPU tensors for each sequence, in order."""
        return [(a, last) for a, last, *_ in self.states_and_routes(sequences)]

    def states_and_routes(self, sequences: list[list[int]]) -> list:
        """(aux [T, K*H], last [T, H], {MoE layer: router scores [T, E]}, {MoE layer: flip sizes ([T], [T])})
        float32 CPU tensors for each sequence, in order; routes and flips are empty unless asked for."""
        import torch

        pool = [_Sequence(i, list(ids)) for i, ids in enumerate(sequences)]
        out: list = [None] * len(pool)
        while pool:
            batch = take_batch(pool, self.policy)
            padded = self.decoder.forward([s.ids for s in batch], keep=True)
            self.batches += 1
            flips = self.decoder.flip_sizes(*padded.shape)
            routes = self.decoder.route_scores(*padded.shape)
            aux, last = self.decoder.outputs()
            for row, s in enumerate(batch):
                n = len(s.ids)
                a = torch.cat([x[row, :n] for x in aux], dim=-1) if aux else last[row, :0]
                r = {i: x[row, :n].cpu() for i, x in routes.items()}
                f = {i: (x[row, :n].cpu(), y[row, :n].cpu()) for i, (x, y) in flips.items()}
                out[s.index] = (a.float().cpu(), last[row, :n].float().cpu(), r, f)
        return out

"""What the driver asks of the hf engine's class before any replica exists: its constructor arguments from
the job's config, and what the manifest records of it (actors/engine.py, "Adding an engine")."""

from __future__ import annotations


class HFEngineSettings:
    name = "hf"
    # Captures are stored as bf16, and the model runs in it (a float reference is reference.py's).
    dtype = "bfloat16"

    @classmethod
    def kwargs_for(
        cls,
        cfg,
        model_dir: str,
        aux_layers: tuple[int, ...],
        cuda: bool,
        cpu_threads: int,
        final_layer: str = "post_norm",
        capture_layout: str = "planes",
        max_prompt_tokens: int | None = None,
        debug: dict | None = None,
    ) -> dict:
        """Constructor arguments from the engine's config section (conf.schema.HFEngineConfig) and the debug
        section's values (conf.schema.DebugConfig, as a dict). `max_prompt_tokens` is not needed here: this
        engine allocates per batch, by max_batch_tokens."""
        debug = debug or {}
        return {
            "model_dir": model_dir,
            "aux_layers": tuple(aux_layers),
            "final_layer": final_layer,
            "capture_layout": capture_layout,
            "device": "cuda" if cuda else "cpu",
            "max_batch_tokens": cfg.max_batch_tokens,
            "cpu_threads": cpu_threads,
            "fill_floor": debug.get("fill_floor"),
            "packing": cfg.packing,
            "cudnn_attention": debug.get("cudnn_attention", "warm"),
            "forward_log": debug.get("forward_log"),
            "pinned_slabs": debug.get("pinned_slabs"),
        }

    @classmethod
    def provenance(cls, kwargs: dict, cuda: bool) -> dict:
        from importlib.metadata import version

        return {
            "name": cls.name,
            "version": f"transformers {version('transformers')}",
            "device": kwargs["device"],
            "dtype": cls.dtype,
            "max_batch_tokens": kwargs["max_batch_tokens"],
            **({"cudnn_attention": kwargs["cudnn_attention"]} if cuda else {}),
            "packing": cls.packing_for(kwargs["packing"], cuda),
        }

    @staticmethod
    def packing_for(packing: str | None, cuda: bool) -> str:
        """engine.packing, None being the device's default (conf/schema.py): packed where the model allows on
        CUDA, padded on a CPU."""
        return packing or ("auto" if cuda else "off")

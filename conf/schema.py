"""The job's configuration: frozen pydantic models, unknown keys are errors.

Each component receives only its own section. GPU counts are derived here, in one place.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, ClassVar, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator


class ConfigError(ValueError):
    """A config file or override that cannot be used; the message says what to change."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class InputConfig(_Strict):
    # A path or glob, local or s3://; every match is read as JSONL.
    path: str
    id_field: str = "id"
    # A longer line becomes an error row without being read into memory (no sample is near this size).
    max_line_bytes: int = Field(64 * 2**20, ge=1024)


class ModelConfig(_Strict):
    # A local HF model directory, or "default" for the embedded SmolLM2-135M-Instruct.
    path: str = "default"


class _EngineBase(_Strict):
    """What every engine has. Each engine's class adds its own knobs and its defaults for each device;
    a knob of another engine is an unknown key (`--set engine.name=hf` then drops nothing silently)."""

    # "auto" uses GPUs when Ray sees any, else the CPU (SGLang's CPU mode, or transformers on the CPU).
    device: Literal["auto", "cpu", "cuda"] = "auto"
    tp_size: int = Field(1, ge=1)
    num_actors: int = Field(1, ge=1)
    # Batches one actor holds at once: while one is validated, encoded and committed, the next is captured.
    # None: the engine's measured best for the device (BATCHES below).
    batches_per_actor: int | None = Field(None, ge=1)
    # CPUs Ray reserves per actor (the engine's threads come on top).
    cpus_per_actor: float = Field(1.0, gt=0)
    # CPU only: threads the engine's torch may use (None: this host's cores / num_actors).
    # Ray pins OMP_NUM_THREADS to the actor's num_cpus, which would leave the engine one thread.
    cpu_threads: int | None = Field(None, ge=1)
    startup_timeout_s: float = Field(600.0, gt=0)

    # (batches per actor, samples per batch) when not set, on (cpu, cuda).
    BATCHES: ClassVar[dict[bool, tuple[int, int]]] = {False: (2, 32), True: (2, 32)}

    def batches(self, cuda: bool) -> int:
        return self.batches_per_actor or self.BATCHES[cuda][0]

    def default_batch_size(self, cuda: bool) -> int:
        return self.BATCHES[cuda][1]

    def gpus_per_actor(self, cuda: bool) -> int:
        return self.tp_size if cuda else 0


class SGLangEngineConfig(_EngineBase):
    # A real SGLang server per actor with the capture hook (patches/).
    name: Literal["sglang"] = "sglang"
    # Requests one actor keeps in flight against its server (shared by all its batches). 16: a plain server's
    # best on a bf16 CPU, and the capture engine alone does as well at 16 as at 8
    # (bench/results/throughput_cpu_bf16.json, server_warmth_cpu.json).
    max_in_flight: int = Field(16, ge=1)
    # Prefill chunk size in tokens: bounds prefill memory (hybrid-attention models need chunking); the hook
    # assembles each request's chunks, so long prompts come out whole. -1 turns chunking off.
    chunked_prefill_size: int = Field(8192, ge=-1)
    server_flags: tuple[str, ...] = ()
    # CPU mode: the dtype the server computes in (states are stored as bf16 either way). auto: float32 where
    # the CPU has no native bf16 matmul (no avx512_bf16/amx_bf16), where bf16 products run several times
    # slower (bench/results/bf16_gemms_cpu.json); the model's own elsewhere. model: always the model's. A --dtype
    # in server_flags overrides both.
    cpu_dtype: Literal["auto", "model", "float32"] = "auto"
    request_timeout_s: float = Field(600.0, gt=0)
    # How long a dump may take to appear after its answer (the hook publishes from a thread).
    dump_timeout_s: float = Field(30.0, gt=0)

    @field_validator("chunked_prefill_size")
    @classmethod
    def _chunk_size(cls, v):
        if v == 0:
            raise ValueError("chunked_prefill_size must be a positive number of tokens, or -1 for no chunking")
        return v


class HFEngineConfig(_EngineBase):
    # transformers in the actor's own process (actors/hf/engine.py): no server, the same shards.
    name: Literal["hf"]
    # Padded tokens per forward (requests are batched by length up to this). On CUDA the engine runs one
    # forward of this size at start, so a size the GPU cannot hold is refused there.
    max_batch_tokens: int = Field(16384, ge=1)
    # Packed forwards: the requests end to end in one row, each attending only to itself, no padding
    # (actors/hf/packing.py). off: padded rows, debug.fill_floor applies; auto: packed wherever the model's
    # attention allows it and a packed forward matches a padded one at start, padded otherwise (logged); on:
    # the same, but an engine that cannot pack fails at start; None: the device's default, auto on a GPU and
    # off on a CPU (unmeasured there). On a GPU a job's padded forwards pay for their padding and for shapes
    # new to the process (cuDNN's per-shape plan, or the flash kernel in its place) and packed ones for neither
    # (bench/results/benchmix_packed_default_h100.json, longtail_packed_default_h100.json).
    packing: Literal["auto", "on", "off"] | None = None

    @field_validator("packing", mode="before")
    @classmethod
    def _yaml_switch(cls, v):
        # YAML reads a bare on/off as true/false.
        return {True: "on", False: "off"}.get(v, v) if isinstance(v, bool) else v

    # On a GPU the engine fills each forward from the requests of every batch it holds: many large batches
    # keep the device busy where a few small ones leave it idle between batches (bench/results/job_h200.json).
    BATCHES: ClassVar[dict[bool, tuple[int, int]]] = {False: (2, 32), True: (16, 128)}

    @field_validator("tp_size")
    @classmethod
    def _one_device(cls, v):
        if v != 1:
            raise ValueError(
                "the hf engine runs on one device; tp_size must be 1 (use engine.name=sglang for tensor parallelism)"
            )
        return v


ENGINE_CONFIGS = {c.model_fields["name"].annotation.__args__[0]: c for c in (SGLangEngineConfig, HFEngineConfig)}
EngineConfig = Annotated[SGLangEngineConfig | HFEngineConfig, Field(discriminator="name")]


class ExtractConfig(_Strict):
    # Decoder layer ids whose output is captured ("output of decoder layer i" = HF hidden_states[i+1]).
    # None: EAGLE-3's default layers, [1, L//2-1, L-4] = HF hidden_states[2, L//2, L-3] (pipeline/driver/plan.py).
    aux_layers: tuple[int, ...] | None = None
    # The final layer as stored: the residual stream entering the model's final norm (pre_norm: speculators
    # trains on it; readers and exports apply the norm, stored with the output, for the post-norm state that
    # SpecForge and Model-Optimizer read), or the norm's output (post_norm: what format-2 outputs hold; a
    # post-norm state cannot be turned back).
    final_layer: Literal["pre_norm", "post_norm"] = "pre_norm"
    max_tokens: int = Field(2048, ge=1)
    # What to do with a sample longer than max_tokens.
    overlength: Literal["truncate", "reject"] = "reject"
    # Extra attempts for a sample whose capture fails validation.
    retries: int = Field(2, ge=0)
    # Samples per actor batch; one batch becomes one shard. None: the engine's default for the device.
    batch_size: int | None = Field(None, ge=1)
    # Where a conversation's samples and masks come from (pipeline/intake/turns.py): full = rendered once, every
    # assistant turn masked as the template renders it there; each = one sample per assistant turn, rendered
    # as the model saw it when it generated that turn (ids <id>#<k>); auto = full where the template is
    # prefix-stable for the conversation (same signal, fewer tokens), each where it is not.
    turns: Literal["full", "each", "auto"] = "auto"
    # Extra variables for the chat template, e.g. {enable_thinking: true}.
    template_kwargs: dict[str, Any] = Field(default_factory=dict)

    @field_validator("template_kwargs")
    @classmethod
    def _template_kwargs(cls, v):
        # These are the job's to set per render; as template variables they would clash or change the samples.
        taken = sorted(
            set(v)
            & {
                "messages",
                "conversation",
                "tools",
                "documents",
                "add_generation_prompt",
                "continue_final_message",
                "tokenize",
                "return_dict",
                "chat_template",
            }
        )
        if taken:
            raise ValueError(
                f"template_kwargs may not set {taken}: the job passes those itself (tools come from each row)"
            )
        return v

    @field_validator("aux_layers")
    @classmethod
    def _layers_distinct(cls, v):
        if v is not None and (len(v) == 0 or len(set(v)) != len(v) or min(v) < 0):
            raise ValueError("aux_layers must be distinct, non-negative layer ids (or null for the default)")
        return v


class OutputConfig(_Strict):
    # Local directory or s3://bucket/prefix.
    path: str
    # planes_zstd: bf16 bits as byte planes, the high plane zstd-compressed;
    # raw: the same planes uncompressed, for storage faster than the CPUs can compress;
    # fp8: lossy, e4m3 with a float32 scale per token per layer, quantized by the engine on its device
    # (every reader gives bf16 back; bench/results/fp8_default_model.json). See pipeline/format/codec.py and
    # the README.
    encoding: Literal["planes_zstd", "raw", "fp8"] = "planes_zstd"
    zstd_level: int = Field(1, ge=1, le=22)
    # Threads one actor uses to compress hidden states (None: min(16, this host's cores)).
    encode_threads: int | None = Field(None, ge=1)
    # A shard's row group is written (and, locally, synced to the disk) once this many MB of encoded samples
    # wait. Smaller: less left to write once a batch's last capture is back (the run's tail); larger: fewer,
    # larger writes and row groups (pipeline/format/shard_writer.py, ROW_GROUP_BYTES).
    row_group_mb: int = Field(64, ge=1, le=2047)
    # all: last_hidden_state at every position [T, H]; masked: only where loss_mask is 1 [M, H]
    # (the reader expands it back, or returns it with its positions).
    last_hidden_state: Literal["all", "masked"] = "all"
    # Refuse to start when the estimated output does not fit the free space of a local output.
    check_free_space: bool = True


class GenerateConfig(_Strict):
    """Regeneration (`harvest regenerate`, or `harvest run` with this section): the target writes the assistant
    turns itself, through the same engines as extraction (pipeline/driver/regenerate.py)."""

    # Where the regenerated JSONL, its error files and its manifest go: local directory or s3://bucket/prefix.
    output: str
    # last: the conversation's final assistant turn; each: every assistant turn in order, turn k generated
    # from the conversation with the regenerated turns before it (on-policy multi-turn).
    policy: Literal["last", "each"] = "last"
    temperature: float = Field(0.0, ge=0)
    top_p: float = Field(1.0, gt=0, le=1)
    max_new_tokens: int = Field(2048, ge=1)
    # Each request's seed is derived from this, the sample id and the turn: a rerun samples the same turns,
    # whichever actor or batch a conversation lands in.
    seed: int = Field(0, ge=0)
    # A turn cut off at max_new_tokens (finish reason `length`) or with no text: an error row with the reason,
    # or kept in the output with the finish reason in its provenance (a flag to filter on).
    on_truncated: Literal["error", "keep"] = "error"
    on_empty: Literal["error", "keep"] = "error"
    # Assistant turns that call tools are left as written (the tool results that follow answer those calls);
    # true regenerates them too, as the text the model writes (its own tool-call syntax), without tool_calls.
    regenerate_tool_turns: bool = False
    # Requests one actor keeps in flight for generation. Decode batches every running request into one
    # step, so throughput grows with the window well past extraction's: 48 was a plain server's best on a CPU
    # (bench/results/regenerate_cpu.json).
    max_in_flight: int = Field(48, ge=1)
    # Conversations per actor batch (one part file each); batches_per_actor of them are held at once, so the
    # window stays full across batch boundaries.
    batch_size: int = Field(32, ge=1)
    batches_per_actor: int = Field(4, ge=1)
    # Extra attempts for a request the engine failed (not for a truncated or empty answer).
    retries: int = Field(2, ge=0)
    # Keep each generated turn's token ids in its provenance (exact tokens, for checks against another engine).
    record_token_ids: bool = False

    def sampling(self) -> dict:
        """The settings that change what is generated (the output's data settings and every row's provenance)."""
        return {
            "policy": self.policy,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "max_new_tokens": self.max_new_tokens,
            "seed": self.seed,
            "regenerate_tool_turns": self.regenerate_tool_turns,
        }


class ProgressConfig(_Strict):
    interval_s: float = Field(10.0, gt=0)


class PlanConfig(_Strict):
    """What planning and resume may use of the driver (README, "Resume at scale"): none of it grows with the input."""

    # Where the planner's ledger (a DuckDB file: every sample's id, source and length, ~100 bytes a sample) lives
    # while the run plans. None: the system's temporary directory.
    ledger_dir: str | None = None
    # Memory the ledger may use before it spills to its directory.
    ledger_memory_mb: int = Field(512, ge=64)
    ledger_threads: int = Field(2, ge=1)
    # Reads in flight of the committed-ids index, and of the committed files it does not cover: object storage
    # answers each request slowly, and one at a time a large output's files take minutes
    # (bench/results/resume_s3_cpu.json).
    read_threads: int = Field(32, ge=1, le=256)
    # Rows per batch of the planner's streams through the driver (samples into the ledger, keys out of it).
    batch_rows: int = Field(65536, ge=1024)
    # While the run goes on, the driver folds the batches' index entries into one per this many batches, so a
    # resume (after a kill or not) reads few entries, each of a bounded size (pipeline/driver/checkpoint.py):
    # faster to the first batch and lighter on the driver than one entry of every id
    # (bench/results/resume_s3_cpu.json).
    checkpoint_every: int = Field(256, ge=1)


class RayConfig(_Strict):
    # None: RAY_ADDRESS / the job's cluster if set, else a local Ray.
    address: str | None = None
    num_cpus: int | None = Field(None, ge=1)
    object_store_memory_mb: int | None = Field(None, ge=75)
    # The dashboard of a Ray this job starts itself (no address). Its processes take CPU from the engine during
    # a job (bench/results/cpu_share_cpu.json); off leaves the one-line status and the logs. A cluster's
    # dashboard is the cluster's own setting.
    dashboard: bool = True


class DebugConfig(_Strict):
    """Profiling and benchmark switches that a production run leaves alone. Each names the engine that reads
    it; the sglang engine reads none of them and ignores them."""

    # hf engine, CUDA: a directory where each engine process writes one JSON line per forward (its shape and
    # device clock, actors/hf/device_clock.py), for benchmarks to replay. None: no log.
    forward_log: str | None = None
    # hf engine, CUDA: pinned host buffers of the largest batch kept for the device-to-host copies
    # (actors/hf/host_copy.py). None: the engine's default; 0: every batch allocates its own.
    pinned_slabs: int | None = Field(None, ge=0)
    # hf engine, CUDA: where attention may use cuDNN's kernel (torch's default pick on recent GPUs). warm: a new
    # forward shape whose attention is light runs the flash kernel, because cuDNN first builds a plan for each
    # shape on the forward thread and a job's forwards rarely repeat one; heavier shapes and shapes that come
    # back run cuDNN's (actors/hf/decoder.py). always: torch decides.
    cudnn_attention: Literal["warm", "always"] = "warm"
    # hf engine, padded forwards: below this share of engine.max_batch_tokens a forward takes more requests
    # whatever their padding (actors/hf/batching.py). None: the device's default (every forward filled on a
    # GPU; 1/8 on a CPU, where padding is all cost); "measured": set on a GPU from the host's launch time and
    # the device's time per token (FillFloor), which lost to the default on both benchmark mixes
    # (bench/results/benchmix_fill_floor_full_h200.json, longtail_fill_floor_full_h200.json).
    fill_floor: float | Literal["measured"] | None = None

    @field_validator("fill_floor")
    @classmethod
    def _share(cls, v):
        if isinstance(v, float) and not 0 < v <= 1:
            raise ValueError(f'fill_floor {v}: a share of max_batch_tokens in (0, 1], "measured", or null')
        return v


class HarvestConfig(_Strict):
    input: InputConfig
    model: ModelConfig = ModelConfig()
    engine: EngineConfig = SGLangEngineConfig()
    extract: ExtractConfig = ExtractConfig()
    # Required by `harvest run`; a config for `harvest regenerate` alone needs only `generate`.
    output: OutputConfig | None = None
    generate: GenerateConfig | None = None
    progress: ProgressConfig = ProgressConfig()
    plan: PlanConfig = PlanConfig()
    ray: RayConfig = RayConfig()
    debug: DebugConfig = DebugConfig()

    @model_validator(mode="before")
    @classmethod
    def _engine_name(cls, data):
        # engine.name chooses the engine's config class; a section that does not name one is SGLang's.
        engine = data.get("engine") if isinstance(data, dict) else None
        if isinstance(engine, dict) and "name" not in engine:
            data = {**data, "engine": {**engine, "name": "sglang"}}
        return data

    def batch_size(self, cuda: bool) -> int:
        return self.extract.batch_size or self.engine.default_batch_size(cuda)

    @model_validator(mode="after")
    def _engine_fits(self):
        if self.engine.device == "cpu" and self.engine.tp_size != 1:
            raise ValueError("engine.tp_size > 1 needs GPUs; set engine.device=cuda or tp_size=1")
        if self.output is None and self.generate is None:
            raise ValueError(
                "output: required (output.path: where the hidden states go; a config only for harvest regenerate "
                "has a generate section instead)"
            )
        if self.output is not None and self.generate is not None and self.output.path == self.generate.output:
            raise ValueError("generate.output and output.path must differ (one holds JSONL, the other shards)")
        return self


def _set_dotted(tree: dict, dotted: str, value: Any) -> None:
    keys = dotted.split(".")
    node = tree
    for k in keys[:-1]:
        node = node.setdefault(k, {})
        if not isinstance(node, dict):
            raise ConfigError(f"--set {dotted}: {k} is not a section")
    node[keys[-1]] = value


def _format_error(err: ValidationError) -> str:
    lines = []
    for e in err.errors():
        loc = list(e["loc"])
        engine = loc[1] if loc[:1] == ["engine"] and len(loc) > 2 and loc[1] in ENGINE_CONFIGS else None
        if engine:  # pydantic names the union member: engine.hf.max_in_flight -> engine.max_in_flight
            del loc[1]
        where = ".".join(str(p) for p in loc)
        owners = [n for n, c in ENGINE_CONFIGS.items() if n != engine and loc[-1] in c.model_fields] if engine else []
        if e["type"] == "extra_forbidden" and owners:
            lines.append(f"  {where}: not a setting of engine.name={engine} (it belongs to engine.name={owners[0]})")
        elif e["type"] == "extra_forbidden" and engine and loc[-1] in DebugConfig.model_fields:
            lines.append(f"  {where}: not a setting of engine (it belongs to debug.{loc[-1]})")
        elif e["type"] == "union_tag_invalid":
            lines.append(f"  {where}: engine.name must be one of {sorted(ENGINE_CONFIGS)}")
        elif e["type"] == "extra_forbidden":
            lines.append(f"  {where}: unknown key (check the spelling against conf/default.yaml)")
        elif e["type"] == "missing":
            lines.append(f"  {where}: required")
        elif not where:  # a check of the whole config; its message names the setting
            lines.append(f"  {e['msg'].removeprefix('Value error, ')}")
        else:
            lines.append(f"  {where}: {e['msg']}")
    return "invalid config:\n" + "\n".join(lines)


def load_config(path: str | Path | None, overrides: list[str] = ()) -> HarvestConfig:
    """Read a YAML file (or nothing) and apply `section.key=value` overrides (values parsed as YAML)."""
    tree: dict = {}
    if path is not None:
        try:
            tree = yaml.safe_load(Path(path).read_text()) or {}
        except FileNotFoundError:
            raise ConfigError(f"config file {path} does not exist") from None
        if not isinstance(tree, dict):
            raise ConfigError(f"{path}: top level must be a mapping of sections")
    for item in overrides:
        key, sep, raw = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"--set {item!r}: expected section.key=value")
        _set_dotted(tree, key.strip(), yaml.safe_load(raw))
    try:
        return HarvestConfig.model_validate(tree)
    except ValidationError as e:
        raise ConfigError(_format_error(e)) from None

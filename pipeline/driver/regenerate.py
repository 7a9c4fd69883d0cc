"""`harvest regenerate`: the target writes the assistant turns itself, through the same actors and engines.

Like the extraction job: the input is read and every line given its sample id first (no tokenizer), which
gives exact totals, finds duplicate ids and lets a rerun drop conversations already committed; then batches
map onto an actor pool of Regenerator stages, and only metadata rows come back here. `harvest run` with a
`generate` section runs this first and extracts on the committed parts (`run_with_generation`).
"""

from __future__ import annotations

import logging
import os
import time
from collections import Counter
from dataclasses import dataclass, field

import pyarrow as pa

from actors.engine import generator_class
from actors.regenerator import Regenerator
from conf import HarvestConfig
from pipeline.driver import support
from pipeline.driver.job import RunSummary, run
from pipeline.driver.preflight import PreflightError, lock_output
from pipeline.driver.quiet import spend_actor_restart_notice
from pipeline.format.errors import DUPLICATES, ERROR_DIR, ErrorRow, reopen_transient_errors, write_errors
from pipeline.format.manifest import check_settings, read_manifest, write_manifest
from pipeline.format.regenerated import PARTS_DIR, committed_ids, committed_totals
from pipeline.format.storage import Store
from pipeline.intake import model as model_lib
from pipeline.intake.conversation import LINE_SCHEMA, RegenerationCodec, identify_lines
from pipeline.intake.read import read_jsonl
from pipeline.intake.tokenize import tokenizer_facts

logger = logging.getLogger(__name__)

FORMAT = "regenerated-jsonl-1"


@dataclass(frozen=True)
class RegenPlan:
    model_dir: str
    cuda: bool
    settings: dict  # what changes the generated rows: compared before a rerun adds to an output
    provenance: dict  # what every row records of how it was made


@dataclass
class RegenSummary:
    totals: dict
    this_run: dict
    reasons: list[tuple[str, int]]
    output: str
    extraction: RunSummary | None = field(default=None)


def plan_regeneration(cfg: HarvestConfig, gpus_available: float) -> RegenPlan:
    gen = cfg.generate
    if gen is None:
        raise PreflightError("harvest regenerate needs a `generate` section (generate.output at least)")
    try:
        model_dir = model_lib.resolve_model(cfg.model.path)
        cuda = cfg.engine.device == "cuda" or (cfg.engine.device == "auto" and gpus_available > 0)
        support.check(model_lib.model_type(model_dir), cfg.engine.name, "cuda" if cuda else "cpu")
        hashes, _ = tokenizer_facts(model_dir)
        fingerprint = model_lib.model_fingerprint(model_dir)
    except model_lib.ModelNotFound as e:
        raise PreflightError(str(e)) from None
    except support.Unsupported as e:
        raise PreflightError(str(e)) from None
    except (OSError, ValueError, KeyError) as e:
        raise PreflightError(f"model.path {cfg.model.path!r} cannot be used: {type(e).__name__}: {e}") from None
    settings = {
        "format": FORMAT,
        "model_sha256": fingerprint,
        **hashes,
        "template_kwargs": dict(cfg.extract.template_kwargs),
        "id_field": cfg.input.id_field,
        **gen.sampling(),
        "on_truncated": gen.on_truncated,
        "on_empty": gen.on_empty,
    }
    provenance = {
        "model": {"name": model_dir.name, "sha256": fingerprint},
        "chat_template_sha256": hashes["chat_template_sha256"],
        "template_kwargs": dict(cfg.extract.template_kwargs),
        "sampling": gen.sampling(),
        "engine": cfg.engine.name,
    }
    return RegenPlan(str(model_dir), cuda, settings, provenance)


def stage_kwargs(cfg: HarvestConfig, plan: RegenPlan) -> dict:
    gen = cfg.generate
    cpu_threads = cfg.engine.cpu_threads or max(1, (os.cpu_count() or 1) // cfg.engine.num_actors)
    engine_kwargs = generator_class(cfg.engine.name).generation_kwargs(
        cfg.engine, plan.model_dir, plan.cuda, cpu_threads, gen.max_in_flight
    )
    codec = RegenerationCodec(
        plan.model_dir, dict(cfg.extract.template_kwargs), cfg.input.id_field, gen.policy, gen.regenerate_tool_turns
    )
    return dict(
        engine_name=cfg.engine.name,
        engine_kwargs=engine_kwargs,
        codec=codec,
        sampling={k: getattr(gen, k) for k in ("temperature", "top_p", "max_new_tokens", "seed")},
        output_url=gen.output,
        provenance=plan.provenance,
        on_truncated=gen.on_truncated,
        on_empty=gen.on_empty,
        retries=gen.retries,
        record_token_ids=gen.record_token_ids,
    )


def regenerate(cfg: HarvestConfig, retry_errors: bool = False) -> RegenSummary:
    """The whole regeneration; refuses (PreflightError, OutputLocked, SettingsMismatch) before any work."""
    import ray

    plan = plan_regeneration(cfg, ray.cluster_resources().get("GPU", 0))
    store = Store(cfg.generate.output)
    with lock_output(store):
        return _regenerate_locked(cfg, plan, store, retry_errors)


def run_with_generation(cfg: HarvestConfig, retry_errors: bool = False, ray_start_s: float | None = None):
    """`harvest run` with `generate`: regenerate, then extract on the committed regenerated rows."""
    regen = regenerate(cfg, retry_errors)
    parts = f"{cfg.generate.output.rstrip('/')}/{PARTS_DIR}/*.jsonl"
    extract_cfg = cfg.model_copy(update={"input": cfg.input.model_copy(update={"path": parts})})
    regen.extraction = run(extract_cfg, retry_errors=retry_errors, ray_start_s=ray_start_s)
    return regen


def _regenerate_locked(cfg: HarvestConfig, plan: RegenPlan, store: Store, retry_errors: bool) -> RegenSummary:
    import ray.data

    ray.data.DataContext.get_current().raise_original_map_exception = True
    spend_actor_restart_notice()
    existing = read_manifest(store)
    check_settings(existing, plan.settings)
    store.clean_temporaries(PARTS_DIR)
    store.clean_temporaries(ERROR_DIR)
    if retry_errors:
        logger.info("--retry-errors: %d conversations with an engine error run again", reopen_transient_errors(store))
    manifest = {
        "format": FORMAT,
        "output": cfg.generate.output,
        "data_settings": plan.settings,
        **plan.provenance,
        "config": cfg.model_dump(mode="json"),
    }
    write_manifest(store, dict(manifest, status="running", totals=(existing or {}).get("totals")))

    lines = read_jsonl(cfg.input.path, cfg.input.max_line_bytes).map_batches(
        identify_lines, fn_kwargs={"id_field": cfg.input.id_field}, batch_format="pyarrow", batch_size=1024
    )
    lines = lines.materialize()
    index = _index(lines)
    dups = find_duplicates(index)
    ids, sources = index["sample_id"].to_pylist(), index["source"].to_pylist()
    if dups:
        skipped = sorted((s, sid) for sid, s in zip(ids, sources) if s in dups)
        write_errors(store, DUPLICATES, [ErrorRow(sid, s, "filtered", "dedup", dups[s]) for s, sid in skipped])
    done = committed_ids(store)
    todo = sum(s not in dups and sid not in done for sid, s in zip(ids, sources))
    logger.info(
        "regenerate: %d input rows: %d already committed, %d duplicates, %d to regenerate (policy %s, "
        "max_new_tokens %d, temperature %g) with engine %s on %s",
        index.num_rows,
        sum(sid in done for sid, s in zip(ids, sources) if s not in dups),
        len(dups),
        todo,
        cfg.generate.policy,
        cfg.generate.max_new_tokens,
        cfg.generate.temperature,
        cfg.engine.name,
        "cuda" if plan.cuda else "cpu",
    )
    this_run = {"rows_ok": 0, "errors": 0, "flagged": 0, "generated_tokens": 0, "prompt_tokens": 0}
    reasons: Counter = Counter()
    if todo:
        _generate(cfg, plan, _still_to_do(lines, set(dups), done), todo, this_run, reasons)
    totals = committed_totals(store)
    totals["filtered"] += len(dups)
    totals["input_rows"] = index.num_rows
    totals["accounted"] = totals["rows_ok"] + totals["errors"] + totals["filtered"]
    write_manifest(store, dict(manifest, status="complete", totals=totals, last_run=this_run))
    return RegenSummary(totals, this_run, reasons.most_common(5), store.display())


def find_duplicates(ids: pa.Table) -> dict[str, str]:
    """(source -> reason) for every input row after the first whose sample ids repeat another row's, ordered by
    (file, line) as the extraction job orders them. Regeneration reads one id per line and keeps the index in the
    driver (tens of thousands of rows; the extraction job's ledger, pipeline/driver/ledger.py, is for millions)."""
    first: dict[str, str] = {}
    dups: dict[str, str] = {}
    for sid, source in sorted(
        zip(ids["sample_id"].to_pylist(), ids["source"].to_pylist()), key=lambda r: _source_key(r[1])
    ):
        if sid in first and first[sid] != source:
            dups.setdefault(source, f"duplicate sample_id {sid!r} (first seen at {first[sid]})")
        else:
            first[sid] = source
    return dups


def _source_key(source: str):
    path, _, line = source.rpartition(":")
    return (path, int(line) if line.isdigit() else 0)


def _index(lines) -> pa.Table:
    import ray

    cols = ["sample_id", "source", "status"]
    tables = [t for t in ray.get(lines.select_columns(cols).to_arrow_refs()) if t.num_rows]
    return pa.concat_tables(tables) if tables else LINE_SCHEMA.empty_table().select(cols)


def _still_to_do(lines, skip_sources: set, done: set):
    """Rows neither committed nor a duplicate's, as an Arrow expression evaluated per block."""
    from ray.data.expressions import col

    keep = None
    for column, values in (("source", skip_sources), ("sample_id", done)):
        if values:
            cond = col(column).not_in(sorted(values))
            keep = cond if keep is None else keep & cond
    return lines if keep is None else lines.filter(expr=keep)


def _generate(cfg: HarvestConfig, plan: RegenPlan, todo, total: int, this_run: dict, reasons: Counter) -> None:
    import ray.data

    gen = cfg.generate
    todo = todo.repartition(target_num_rows_per_block=gen.batch_size, strict=True)
    results = todo.map_batches(
        Regenerator,
        fn_constructor_kwargs=stage_kwargs(cfg, plan),
        batch_size=gen.batch_size,
        batch_format="pyarrow",
        # Several batches per actor on threads share the engine's window: it never drains at a batch's end.
        compute=ray.data.ActorPoolStrategy(
            min_size=cfg.engine.num_actors,
            max_size=cfg.engine.num_actors,
            max_tasks_in_flight_per_actor=gen.batches_per_actor,
            max_concurrent_calls_per_actor=gen.batches_per_actor,
            enable_true_multi_threading=True,
        ),
        num_gpus=cfg.engine.gpus_per_actor(plan.cuda),
        num_cpus=cfg.engine.cpus_per_actor,
    )
    attempts = generator_class(cfg.engine.name).start_attempts
    results.context.wait_for_min_actors_s = int(cfg.engine.startup_timeout_s * attempts) + 60
    t0 = last_log = time.monotonic()
    ready: dict[str, float] = {}
    decided = 0
    for batch in results.iter_batches(batch_format="pyarrow", batch_size=None):
        statuses = batch["status"].to_pylist()
        decided += len(statuses)
        this_run["rows_ok"] += statuses.count("ok")
        this_run["errors"] += len(statuses) - statuses.count("ok")
        this_run["flagged"] += sum(batch["flagged"].to_pylist())
        this_run["generated_tokens"] += sum(batch["completion_tokens"].to_pylist())
        this_run["prompt_tokens"] += sum(batch["prompt_tokens"].to_pylist())
        ready.update(zip(batch["actor"].to_pylist(), batch["engine_ready_unix"].to_pylist()))
        this_run["last_result_unix"] = max(batch["finished_unix"].to_pylist())
        reasons.update(r.split(" (after")[0][:80] for r, st in zip(batch["reason"].to_pylist(), statuses) if st != "ok")
        if time.monotonic() - last_log >= cfg.progress.interval_s:
            last_log = time.monotonic()
            logger.info(
                "regenerate: %d/%d rows (%d errors), %d tokens generated, %.1f tok/s",
                decided,
                total,
                this_run["errors"],
                this_run["generated_tokens"],
                this_run["generated_tokens"] / max(last_log - t0, 1e-9),
            )
    this_run["seconds"] = round(time.monotonic() - t0, 3)
    if ready:
        # Decode throughput once every engine was up: what the engines did, without start-up.
        start = max(ready.values())
        span = this_run["last_result_unix"] - start
        this_run["engines_ready_unix"] = start
        this_run["tokens_per_second_after_engine_start"] = round(this_run["generated_tokens"] / max(span, 1e-9), 1)
    logger.info(
        "regenerate: %d ok (%d flagged), %d errors, %d tokens generated in %.1fs",
        this_run["rows_ok"],
        this_run["flagged"],
        this_run["errors"],
        this_run["generated_tokens"],
        this_run["seconds"],
    )

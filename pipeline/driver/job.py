"""The job: build the lazy Ray Datasets and drive them. Never calls ray.init (the CLI decides the cluster).

Two phases. Tokenize is cheap and small (token ids only), so it is materialized first (in Ray's object store,
which spills to disk): that gives exact totals for progress, finds duplicate ids, and lets resume drop samples
already committed, all decided in an on-disk ledger (work.py), never as every id in driver memory.
Then extraction maps batches onto the actor pool; only metadata rows come back to the driver.
"""

from __future__ import annotations

import importlib.metadata
import logging
import os
import time
from collections import Counter
from dataclasses import dataclass

from actors.engine import engine_class
from actors.extractor import HiddenStateExtractor
from conf import HarvestConfig
from pipeline.driver import support
from pipeline.driver.budget import check_budget, estimate_bytes
from pipeline.driver.checkpoint import IndexCheckpoint
from pipeline.driver.plan import Plan
from pipeline.driver.preflight import check_gpus, cluster_gpus_per_node, lock_output, plan_or_refuse
from pipeline.driver.progress import Progress, startup, startup_line
from pipeline.driver.quiet import spend_actor_restart_notice
from pipeline.driver.work import Work, decide_work, still_to_do
from pipeline.format.errors import ERROR_DIR, reopen_transient_errors
from pipeline.format.ids_index import INDEX_DIR
from pipeline.format.manifest import base_manifest, check_settings, committed_totals, read_manifest, write_manifest
from pipeline.format.shards import SHARD_DIR
from pipeline.format.storage import Store, human_bytes
from pipeline.intake.model import vocab_size
from pipeline.intake.read import read_jsonl
from pipeline.intake.stage import TokenizeLines

logger = logging.getLogger(__name__)


def tokenized_dataset(cfg: HarvestConfig, plan: Plan):
    import ray.data

    return read_jsonl(cfg.input.path, cfg.input.max_line_bytes).map_batches(
        TokenizeLines,
        fn_constructor_kwargs=dict(
            model_dir=str(plan.model_dir),
            max_tokens=cfg.extract.max_tokens,
            overlength=cfg.extract.overlength,
            id_field=cfg.input.id_field,
            turns=cfg.extract.turns,
            template_kwargs=dict(cfg.extract.template_kwargs),
            vocab_size=plan.tokenizer_size,
        ),
        batch_format="pyarrow",
        batch_size=256,
        # Tokenizing is CPU-bound and cheap next to extraction; a few actors keep it off the critical path.
        compute=ray.data.ActorPoolStrategy(min_size=1, max_size=4),
    )


def extractor_kwargs(cfg: HarvestConfig, plan: Plan) -> dict:
    cpu_threads = cfg.engine.cpu_threads or max(1, (os.cpu_count() or 1) // cfg.engine.num_actors)
    kwargs = engine_class(cfg.engine.name).kwargs_for(
        cfg.engine,
        str(plan.model_dir),
        plan.layout.aux_layers,
        plan.cuda,
        cpu_threads,
        plan.layout.final_layer,
        plan.layout.codec.layout,
        max_prompt_tokens=cfg.extract.max_tokens,
        debug=cfg.debug.model_dump(),
    )
    return dict(
        engine_name=cfg.engine.name,
        engine_kwargs=kwargs,
        layout=plan.layout,
        output_url=cfg.output.path,
        retries=cfg.extract.retries,
        encode_threads=cfg.output.encode_threads,
        row_group_bytes=cfg.output.row_group_mb << 20,
    )


@dataclass(frozen=True)
class RunSummary:
    """What a run did: the output's totals (as the manifest records them), this run's counters, its most
    common error reasons, and where the output is."""

    totals: dict
    this_run: Progress
    reasons: list[tuple[str, int]]
    output: str


def run(cfg: HarvestConfig, retry_errors: bool = False, ray_start_s: float | None = None) -> RunSummary:
    """The whole job; refuses (PreflightError, OutputLocked) before any extraction when it cannot work.

    retry_errors: samples whose committed error is transient (engine/extract stage) run again.
    ray_start_s: how long the caller's ray.init took (the start-up line's first part), if it started Ray.
    """
    import ray

    plan = plan_or_refuse(cfg, ray.cluster_resources().get("GPU", 0))
    check_gpus(cfg, plan.cuda, cluster_gpus_per_node())
    store = Store(cfg.output.path)
    with lock_output(store):
        return _run_locked(cfg, plan, store, retry_errors, ray_start_s)


def _run_locked(
    cfg: HarvestConfig, plan: Plan, store: Store, retry_errors: bool, ray_start_s: float | None = None
) -> RunSummary:
    import ray.data

    # A stage that raises (storage full or gone) fails the run with its own exception, not Ray Data's wrapper
    # whose cause is lost on the way to the driver: the CLI names the real cause in its one line. Set before
    # any dataset is built: a dataset keeps the context it was created with.
    ray.data.DataContext.get_current().raise_original_map_exception = True
    spend_actor_restart_notice()
    existing = _open_output(store, plan, retry_errors)
    manifest = base_manifest(cfg.output.path, plan.settings, provenance(cfg, plan), cfg.model_dump(mode="json"))
    write_manifest(store, dict(manifest, status="running", totals=(existing or {}).get("totals")))
    t0 = time.monotonic()
    tokenized = tokenized_dataset(cfg, plan).materialize()
    read_s = time.monotonic() - t0
    work = _decide_work(cfg, plan, store, tokenized)
    manifest["conversations"] = {k: v for k, v in work.conversations.items() if k != "plan"}
    need = check_budget(store, plan.layout, work.tokens, work.masked, cfg.output.check_free_space)
    manifest["storage_estimate"] = {"encoding": plan.layout.encoding, "bytes": need}
    progress = Progress(work.rows, work.tokens, cfg.progress.interval_s)
    reasons: Counter = Counter()
    extract_started = time.time()
    if work.rows:
        _extract(
            cfg,
            plan,
            still_to_do(tokenized, work.skip),
            progress,
            reasons,
            IndexCheckpoint(store, cfg.plan.checkpoint_every),
        )
    start = startup(ray_start_s, read_s, extract_started, progress.actors)
    logger.info("%s", startup_line(start))
    totals = _totals(store, work, cfg.plan.read_threads)
    write_manifest(
        store, dict(manifest, status="complete", totals=totals, last_run=_last_run(progress) | {"startup": start})
    )
    return RunSummary(totals, progress, reasons.most_common(5), store.display())


def _open_output(store: Store, plan: Plan, retry_errors: bool) -> dict | None:
    """The output's manifest (None for a new output) once its settings match this run's; partial files of
    an earlier run are gone, and with --retry-errors its transient errors are open again."""
    existing = read_manifest(store)
    check_settings(existing, plan.settings)
    store.clean_temporaries(SHARD_DIR)
    store.clean_temporaries(ERROR_DIR)
    store.clean_temporaries(INDEX_DIR)
    if retry_errors:
        n = reopen_transient_errors(store)
        logger.info("--retry-errors: %d samples with a transient (engine/extract) error will run again", n)
    return existing


def _decide_work(cfg: HarvestConfig, plan: Plan, store: Store, tokenized) -> Work:
    """Drop duplicated rows (recorded in the duplicates file) and samples already committed; log the plan."""
    t0 = time.monotonic()
    work = decide_work(tokenized, store, cfg.extract.turns, cfg.plan)
    logger.info("planned in %.1f s; %s", time.monotonic() - t0, work.index.line())
    logger.info(
        "%d input rows -> %d samples: %d already committed, %d duplicates, %d to process (%d tokens, ~%s in %s), "
        "device=%s; %s; %s with %s: %s",
        work.input_rows,
        work.samples,
        work.committed_samples,
        work.duplicate_samples,
        work.rows,
        work.tokens,
        human_bytes(estimate_bytes(plan.layout, work.tokens, work.masked)),
        plan.layout.encoding,
        "cuda" if plan.cuda else "cpu",
        work.conversations["plan"],
        plan.support.get("family"),
        plan.support.get("engine"),
        plan.support.get("status"),
    )
    if plan.support.get("status") != support.CHECKED_HERE:
        logger.warning(
            '%s on engine %s on %s is %s by this project (README, "Support"): audit the output before training',
            *(plan.support.get(k) for k in ("family", "engine", "device", "status")),
        )
    if work.conversations["unrendered"]:
        logger.warning(
            "the chat template does not render some fields, which are kept out of those samples: %s "
            "(a template that reads them, e.g. one with reasoning or tool support, would train on them)",
            ", ".join(f"{k} in {n} sample(s)" for k, n in sorted(work.conversations["unrendered"].items())),
        )
    return work


def _totals(store: Store, work: Work, read_threads: int) -> dict:
    """The output's totals from its committed files, and this input's: ok + errors + filtered == samples."""
    totals = committed_totals(store, read_threads)
    totals["filtered"] += work.duplicate_samples
    totals["input_rows"] = work.input_rows
    totals["samples"] = work.samples
    totals["accounted"] = totals["samples_ok"] + totals["errors"] + totals["filtered"]
    return totals


def _last_run(progress: Progress) -> dict:
    """This run's counters and rates for the manifest."""
    first = progress.first_result_at
    return {
        "samples_ok": progress.ok,
        "errors": progress.errors,
        "tokens": progress.tokens,
        "bytes": progress.bytes,
        "extract_seconds": round(progress.elapsed(), 3),
        "tokens_per_second": round(progress.tokens / max(progress.elapsed(), 1e-9), 1),
        "first_result_seconds": round(first - progress.started, 3) if first else None,
        "steady_tokens_per_second": round(progress.steady_tokens_per_second() or 0.0, 1),
        "tokens_per_second_after_engine_start": round(progress.tokens_per_second_after_engine_start() or 0.0, 1),
        # The window that rate covers (wall clock), to set against the engines' own timestamps in per_actor.
        "engines_ready_unix": progress.engines_ready_unix,
        "last_result_unix": progress.last_result_unix or None,
        "per_actor": progress.actors,
    }


def _extract(
    cfg: HarvestConfig, plan: Plan, todo, progress: Progress, reasons: Counter, checkpoint: IndexCheckpoint
) -> None:
    """Map the remaining samples onto the actor pool; consume only their metadata rows here."""
    import ray.data

    # One block per actor batch: every actor gets work, and each committed shard reports back at once
    # (a large block would run on one actor and return all its metadata rows at the end).
    batch_size, batches = cfg.batch_size(plan.cuda), cfg.engine.batches(plan.cuda)
    todo = todo.repartition(target_num_rows_per_block=batch_size, strict=True)
    results = todo.map_batches(
        HiddenStateExtractor,
        fn_constructor_kwargs=extractor_kwargs(cfg, plan),
        batch_size=batch_size,
        batch_format="pyarrow",
        # Several batches per actor on threads: one encodes and commits while the next keeps the server busy.
        compute=ray.data.ActorPoolStrategy(
            min_size=cfg.engine.num_actors,
            max_size=cfg.engine.num_actors,
            max_tasks_in_flight_per_actor=batches,
            max_concurrent_calls_per_actor=batches,
            enable_true_multi_threading=True,
        ),
        num_gpus=cfg.engine.gpus_per_actor(plan.cuda),
        num_cpus=cfg.engine.cpus_per_actor,
    )
    # Hand out batches only once every actor's engine is up: otherwise the first actor ready takes
    # batches_per_actor batches at once and, on a short input, the others get little or nothing
    # (seen with two GPU actors on a short input: every batch went to the first one up). The setting lives in the
    # dataset's own copy of the context.
    attempts = engine_class(cfg.engine.name).start_attempts
    wait_s = int(cfg.engine.startup_timeout_s * attempts) + 60
    results.context.wait_for_min_actors_s = wait_s
    progress.maybe_log(force=True)
    for batch in _batches_once_engines_start(results, wait_s, attempts, cfg.engine.startup_timeout_s):
        statuses = batch["status"].to_pylist()
        progress.update(statuses, batch["num_tokens"].to_pylist(), batch["bytes"].to_pylist())
        progress.update_actors(
            batch["actor"].to_pylist(),
            batch["engine_ready_unix"].to_pylist(),
            statuses,
            batch["num_tokens"].to_pylist(),
            batch["batch_started_unix"].to_pylist(),
            batch["engine_stats"].to_pylist(),
        )
        reasons.update(r.split(" (after")[0][:80] for r, st in zip(batch["reason"].to_pylist(), statuses) if st != "ok")
        checkpoint.add_batch(
            batch["sample_id"].to_pylist(),
            statuses,
            batch["num_tokens"].to_pylist(),
            batch["bytes"].to_pylist(),
            batch["shard"].to_pylist(),
            batch["errors_bytes"][0].as_py() if batch.num_rows else 0,
        )
        progress.maybe_log()
    checkpoint.flush()
    progress.maybe_log(force=True)


class EngineStartTimeout(RuntimeError):
    """The actors' engines were not all up within their start-up budget."""


def _batches_once_engines_start(results, wait_s: int, attempts: int, timeout_s: float):
    """The results' batches; Ray's own timeout for the actors' start (which blames the cluster's resources)
    becomes one that names the setting to change."""
    import ray

    try:
        yield from results.iter_batches(batch_format="pyarrow", batch_size=None)
    except ray.exceptions.GetTimeoutError as e:
        if "starting actors" not in str(e):
            raise
        raise EngineStartTimeout(
            f"the engines were not all up after {wait_s} s ({attempts} start attempt(s) of "
            f"engine.startup_timeout_s={timeout_s:g} each); a large model may need a higher "
            "engine.startup_timeout_s, and each actor's log (Ray dashboard) holds its engine's last lines"
        ) from None


def provenance(cfg: HarvestConfig, plan: Plan) -> dict:
    kwargs = extractor_kwargs(cfg, plan)["engine_kwargs"]
    return {
        "model": {"path": str(plan.model_dir), "name": plan.model_dir.name, "vocab_size": vocab_size(plan.model_dir)},
        "engine": engine_class(cfg.engine.name).provenance(kwargs, plan.cuda),
        "software": {p: _version(p) for p in ("hidden-harvest", "ray", "pyarrow", "torch", "transformers")},
        "aux_layers": list(plan.layout.aux_layers),
        "hidden_size": plan.layout.hidden_size,
        "aux_width": plan.layout.aux_width,
        "encoding": plan.layout.metadata(),
        "support": plan.support,
    }


def _version(pkg: str) -> str:
    try:
        return importlib.metadata.version(pkg)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"

"""`harvest run | regenerate | inspect | verify | audit | export`: decides the cluster and the config, then hands over to the job."""

from __future__ import annotations

import argparse
import gc
import logging
import os
import sys
import time

from conf import ConfigError, load_config
from pipeline import envs
from pipeline.driver.budget import InsufficientSpace
from pipeline.driver.failures import failure_message
from pipeline.driver.job import run
from pipeline.driver.preflight import PreflightError
from pipeline.driver.regenerate import regenerate, run_with_generation
from pipeline.format.lock import OutputLocked
from pipeline.format.manifest import SettingsMismatch
from pipeline.format.storage import human_bytes, redact
from pipeline.tools.audit import AuditError, audit
from pipeline.tools.export import ExportError, export
from pipeline.tools.fidelity import SAMPLE_FACTOR, TOKEN_FACTOR, NoiseRule
from pipeline.tools.inspect import summarize
from pipeline.tools.verify import verify

logger = logging.getLogger("harvest")


def _setup_logging() -> None:
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s", datefmt="%H:%M:%S"
    )


def _dashboard_installed() -> bool:
    """Whether this Ray can start its dashboard; a minimal Ray (no `ray[default]`) refuses to start at all when asked."""
    try:
        import ray.dashboard.optional_deps  # noqa: F401  (the import Ray itself checks before starting one)
    except ImportError as e:
        logger.warning(
            "ray.dashboard: this Ray has no dashboard (%s; it comes with ray[default]): starting without it", e
        )
        return False
    return True


def _init_ray(cfg) -> float | None:
    """Starts or joins the cluster; the seconds it took, or None when this process already had Ray."""
    os.environ.setdefault(envs.RAY_USAGE_STATS.name, "0")
    # Ray Data's per-operator progress in non-interactive logs (ray job logs), at the job's interval.
    os.environ.setdefault(envs.RAY_PROGRESS_INTERVAL.name, str(max(1, int(cfg.progress.interval_s))))
    import ray

    if ray.is_initialized():  # embedded in a process that already chose its cluster (tests, notebooks)
        return None
    t0 = time.monotonic()
    address = cfg.ray.address or envs.RAY_ADDRESS.get()
    kwargs = {"log_to_driver": True}
    if address:
        kwargs["address"] = address
    else:
        kwargs["num_cpus"] = cfg.ray.num_cpus
        kwargs["include_dashboard"] = cfg.ray.dashboard and _dashboard_installed()
        if cfg.ray.object_store_memory_mb:
            kwargs["object_store_memory"] = cfg.ray.object_store_memory_mb * 2**20
    ray.init(**kwargs)
    # Bars on a terminal; elsewhere the logged per-operator lines above.
    ray.data.DataContext.get_current().enable_progress_bars = sys.stderr.isatty()
    return time.monotonic() - t0


def cmd_run(args) -> int:

    cfg = load_config(args.config, args.set or [])
    if cfg.output is None:
        raise ConfigError("harvest run needs an output section (output.path: where the hidden states go)")
    ray_s = _init_ray(cfg)
    regen = None
    if cfg.generate is not None:
        regen = run_with_generation(cfg, retry_errors=args.retry_errors, ray_start_s=ray_s)
        print(_regen_lines(regen))
        summary = regen.extraction
    else:
        summary = run(cfg, retry_errors=args.retry_errors, ray_start_s=ray_s)
    t = summary.totals
    p = summary.this_run
    samples = t.get("samples", t["input_rows"])
    # One sample per input row unless extract.turns splits conversations into one sample per assistant turn.
    whole = (
        f"{t['input_rows']:,} input rows"
        if samples == t["input_rows"]
        else f"{samples:,} samples from {t['input_rows']:,} input rows"
    )
    lines = [
        f"output: {summary.output}",
        f"this run: {p.ok:,} ok, {p.errors:,} errors, {p.filtered:,} filtered, {p.tokens:,} tokens, "
        f"{human_bytes(p.bytes)} ({p.bytes:,} bytes) committed",
        f"output totals: {t['samples_ok']:,} ok + {t['errors']:,} errors + {t['filtered']:,} filtered = "
        f"{t['accounted']:,} of {whole}; {t['tokens']:,} tokens; "
        f"{human_bytes(t['bytes'])} ({t['bytes']:,} bytes) in {t['shards']} shards",
    ]
    if summary.reasons:
        lines.append("top error reasons: " + "; ".join(f"{n}x {r}" for r, n in summary.reasons))
    print("\n".join(lines))
    complete = regen is None or regen.totals["accounted"] == regen.totals["input_rows"]
    return 0 if t["accounted"] == samples and complete else 1


def _regen_lines(summary) -> str:
    t, r = summary.totals, summary.this_run
    lines = [
        f"regenerated: {summary.output}",
        f"this run: {r['rows_ok']:,} ok ({r['flagged']:,} flagged), {r['errors']:,} errors, "
        f"{r['generated_tokens']:,} tokens generated"
        + (
            f", {r['tokens_per_second_after_engine_start']:,.1f} tok/s"
            if "tokens_per_second_after_engine_start" in r
            else ""
        ),
        f"output totals: {t['rows_ok']:,} ok + {t['errors']:,} errors + {t['filtered']:,} filtered = "
        f"{t['accounted']:,} of {t['input_rows']:,} input rows; {t['generated_tokens']:,} tokens generated "
        f"in {t['parts']} parts",
    ]
    if summary.reasons:
        lines.append("top error reasons: " + "; ".join(f"{n}x {r}" for r, n in summary.reasons))
    return "\n".join(lines)


def cmd_regenerate(args) -> int:
    cfg = load_config(args.config, args.set or [])
    if cfg.generate is None:
        raise ConfigError("harvest regenerate needs a generate section (generate.output at least)")
    _init_ray(cfg)
    summary = regenerate(cfg, retry_errors=args.retry_errors)
    print(_regen_lines(summary))
    return 0 if summary.totals["accounted"] == summary.totals["input_rows"] else 1


def cmd_inspect(args) -> int:

    print(summarize(args.output))
    return 0


def cmd_verify(args) -> int:

    report = verify(args.output)
    print(report.text(args.output))
    return 0 if report.ok else 1


def cmd_audit(args) -> int:

    samples = None if args.samples == "all" else int(args.samples)
    report = audit(
        args.output,
        samples=samples,
        device=args.device,
        seed=args.seed,
        model=args.model,
        rule=NoiseRule(args.sample_factor, args.token_factor),
    )
    print(report.text())
    print(f"report: {report.output.rstrip('/')}/audit.json")
    return 0 if report.ok else 1


def cmd_export(args) -> int:
    report = export(
        args.output,
        args.to,
        args.dest,
        workers=args.workers,
        draft_vocab=args.draft_vocab,
        target_vocab=args.target_vocab,
        fp8=None if args.dtype is None else args.dtype == "fp8",
    )
    print(report.text())
    return 0 if report.ok else 1


def _samples(value: str) -> str:
    if value != "all" and not (value.isdigit() and int(value) > 0):
        raise argparse.ArgumentTypeError("a positive number of samples, or `all`")
    return value


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="harvest", description="Hidden-state training data for EAGLE-3 draft models.")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("run", help="run the job")
    p.add_argument("config", help="a YAML file in conf/")
    p.add_argument("--set", action="append", metavar="SECTION.KEY=VALUE", help="override a config value")
    p.add_argument(
        "--retry-errors",
        action="store_true",
        help="run again the samples whose error was transient (engine/extract stage); parse and tokenize errors stay",
    )
    p.set_defaults(fn=cmd_run)
    p = sub.add_parser("regenerate", help="the target writes the assistant turns itself (the generate section)")
    p.add_argument("config", help="a YAML file in conf/ with a generate section")
    p.add_argument("--set", action="append", metavar="SECTION.KEY=VALUE", help="override a config value")
    p.add_argument("--retry-errors", action="store_true", help="run again the conversations whose engine failed")
    p.set_defaults(fn=cmd_regenerate)
    p = sub.add_parser("inspect", help="summarize an output (local dir or s3://)")
    p.add_argument("output")
    p.set_defaults(fn=cmd_inspect)
    p = sub.add_parser("verify", help="integrity scan of an output; exit code 0 only when every check holds")
    p.add_argument("output")
    p.set_defaults(fn=cmd_verify)
    p = sub.add_parser(
        "audit", help="recompute random committed samples with transformers and judge them by bf16 noise"
    )
    p.add_argument("output")
    p.add_argument("--samples", type=_samples, default="16", help="how many random samples, or `all` (default 16)")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--seed", type=int, default=0, help="which random samples (default 0)")
    p.add_argument("--model", help="the model directory, when it is not where the manifest says")
    p.add_argument(
        "--sample-factor",
        type=float,
        default=SAMPLE_FACTOR,
        help="a sample's mean distance to float32 may be this many times a bf16 forward's (default %(default)s)",
    )
    p.add_argument(
        "--token-factor",
        type=float,
        default=TOKEN_FACTOR,
        help="a token's distance may be this many times the bf16 forward's there (default %(default)s)",
    )
    p.set_defaults(fn=cmd_audit)
    p = sub.add_parser(
        "export", help="write an output in a draft trainer's layout (SpecForge, speculators, Model-Optimizer)"
    )
    p.add_argument("output")
    p.add_argument("--to", required=True, choices=("specforge", "speculators", "modelopt"))
    p.add_argument("dest", help="where the trainer's files go (local dir or s3://); a rerun completes it")
    p.add_argument("--workers", type=int, default=None, help="shards exported at once (default: the cores, up to 16)")
    p.add_argument(
        "--draft-vocab",
        type=int,
        default=None,
        metavar="N",
        help="also write the trainer's draft vocabulary (d2t/t2d): the N most frequent trained tokens",
    )
    p.add_argument(
        "--target-vocab",
        type=int,
        default=None,
        metavar="V",
        help="the target's vocabulary size, where the output's manifest does not say it (older outputs)",
    )
    p.add_argument(
        "--dtype",
        choices=("bf16", "fp8"),
        default=None,
        help="speculators only: its FP8 files (e4m3 + a scale per token) or bf16; default fp8 for an "
        "output.encoding=fp8 output, else bf16",
    )
    p.set_defaults(fn=cmd_export)
    args = parser.parse_args(argv)
    _setup_logging()

    try:
        return args.fn(args)
    except (
        ConfigError,
        InsufficientSpace,
        SettingsMismatch,
        AuditError,
        ExportError,
        FileNotFoundError,
        PreflightError,
        OutputLocked,
    ) as e:
        # Refusals with an actionable message: no traceback.
        print(f"harvest: {redact(str(e))}", file=sys.stderr)
        return 2
    except Exception as e:  # noqa: BLE001 -- a failure mid-run: one line that names the cause; details in the log
        logger.debug("the run failed", exc_info=True)
        print(f"harvest: {failure_message(e)}", file=sys.stderr)
    # The failed run's frames hold its Ray Data executor in reference cycles, and through it the extractor
    # actors and their servers: collect them now, so a process that lives on (a notebook, tests) gets them back.
    gc.collect()
    return 1


if __name__ == "__main__":
    sys.exit(main())

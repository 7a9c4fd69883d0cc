"""`harvest run | inspect | verify`: decides the cluster and the config, then hands over to the job."""

from __future__ import annotations

import argparse
import logging
import os
import sys

logger = logging.getLogger("harvest")


def _setup_logging() -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s", datefmt="%H:%M:%S")


def _init_ray(cfg) -> None:
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    # Ray Data's per-operator progress in non-interactive logs (ray job logs), at the job's interval.
    os.environ.setdefault("RAY_DATA_NON_TTY_PROGRESS_LOG_INTERVAL", str(max(1, int(cfg.progress.interval_s))))
    import ray

    if ray.is_initialized():  # embedded in a process that already chose its cluster (tests, notebooks)
        return
    address = cfg.ray.address or os.environ.get("RAY_ADDRESS")
    kwargs = {"log_to_driver": True}
    if address:
        kwargs["address"] = address
    else:
        kwargs["num_cpus"] = cfg.ray.num_cpus
        if cfg.ray.object_store_memory_mb:
            kwargs["object_store_memory"] = cfg.ray.object_store_memory_mb * 2**20
    ray.init(**kwargs)
    # Bars on a terminal; elsewhere the logged per-operator lines above.
    ray.data.DataContext.get_current().enable_progress_bars = sys.stderr.isatty()


def cmd_run(args) -> int:
    from conf import load_config
    from pipeline.job import run
    from pipeline.progress import human_bytes

    cfg = load_config(args.config, args.set or [])
    _init_ray(cfg)
    summary = run(cfg, retry_errors=args.retry_errors)
    t = summary["totals"]
    p = summary["this_run"]
    lines = [
        f"output: {summary['output']}",
        f"this run: {p.ok:,} ok, {p.errors:,} errors, {p.filtered:,} filtered, {p.tokens:,} tokens, "
        f"{human_bytes(p.bytes)} ({p.bytes:,} bytes) committed",
        f"output totals: {t['samples_ok']:,} ok + {t['errors']:,} errors + {t['filtered']:,} filtered = "
        f"{t['accounted']:,} of {t['input_rows']:,} input rows; {t['tokens']:,} tokens; "
        f"{human_bytes(t['bytes'])} ({t['bytes']:,} bytes) in {t['shards']} shards",
    ]
    if summary["reasons"]:
        lines.append("top error reasons: " + "; ".join(f"{n}x {r}" for r, n in summary["reasons"]))
    print("\n".join(lines))
    return 0 if t["accounted"] == t["input_rows"] else 1


def cmd_inspect(args) -> int:
    from pipeline.inspect import summarize

    print(summarize(args.output))
    return 0


def cmd_verify(args) -> int:
    from pipeline.verify import verify

    report = verify(args.output)
    print(report.text(args.output))
    return 0 if report.ok else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="harvest", description="Hidden-state training data for EAGLE-3 draft models.")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("run", help="run the job")
    p.add_argument("config", help="a YAML file in conf/")
    p.add_argument("--set", action="append", metavar="SECTION.KEY=VALUE", help="override a config value")
    p.add_argument("--retry-errors", action="store_true",
                   help="run again the samples whose error was transient (engine/extract stage); parse and tokenize errors stay")  # fmt: skip
    p.set_defaults(fn=cmd_run)
    p = sub.add_parser("inspect", help="summarize an output (local dir or s3://)")
    p.add_argument("output")
    p.set_defaults(fn=cmd_inspect)
    p = sub.add_parser("verify", help="integrity scan of an output; exit code 0 only when every check holds")
    p.add_argument("output")
    p.set_defaults(fn=cmd_verify)
    args = parser.parse_args(argv)
    _setup_logging()
    from conf import ConfigError
    from pipeline.budget import InsufficientSpace
    from pipeline.lock import OutputLocked
    from pipeline.manifest import SettingsMismatch
    from pipeline.preflight import PreflightError
    from pipeline.storage import redact

    try:
        return args.fn(args)
    except (ConfigError, InsufficientSpace, SettingsMismatch, FileNotFoundError, PreflightError, OutputLocked) as e:
        # Refusals with an actionable message: no traceback.
        print(f"harvest: {redact(str(e))}", file=sys.stderr)
        return 2
    except Exception as e:  # noqa: BLE001 -- a failure mid-run: one line that names the cause; details in the log
        logger.debug("the run failed", exc_info=True)
        print(f"harvest: {failure_message(e)}", file=sys.stderr)
        return 1


def root_cause(e: BaseException) -> BaseException:
    """The innermost exception: through `raise ... from`, implicit context, and Ray's task errors (`.cause`)."""
    seen: set[int] = set()
    while id(e) not in seen:
        seen.add(id(e))
        cause = getattr(e, "cause", None)
        nxt = cause if isinstance(cause, BaseException) else (e.__cause__ or e.__context__)
        if nxt is None:
            break
        e = nxt
    return e


def failure_message(e: BaseException) -> str:
    import errno

    from pipeline.storage import redact

    cause = root_cause(e)
    if isinstance(cause, OSError) and cause.errno is not None:
        # Not str(): an OSError that crossed from a Ray worker carries Ray's retry message as its filename.
        text = f"[Errno {cause.errno}] {cause.strerror}"
    else:
        text = str(cause).strip().splitlines()[0] if str(cause).strip() else ""
    what = f"{type(cause).__name__}: {text}"[:400]
    if isinstance(cause, OSError) and cause.errno == errno.ENOSPC:
        hint = "the output's storage is full; free space and rerun the same command"
    else:
        hint = "fix the cause and rerun the same command"
    return redact(
        f"the run failed: {what}. Everything committed before the failure is kept (no partial shard is ever "
        f"visible); {hint} to continue where it stopped."
    )


if __name__ == "__main__":
    sys.exit(main())

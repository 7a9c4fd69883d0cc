"""The `--set` items a benchmark passes to a job, split from those that are environment variables."""

from __future__ import annotations

from pipeline.envs import RETIRED

# Benchmark switches that are settings of the job's debug section (conf/schema.py, DebugConfig), not
# environment variables: passed as one, they would be ignored.
DEBUG_SETTINGS = RETIRED


def split_env(items: list[str]) -> tuple[list[str], dict[str, str]]:
    """(config sets, environment): a KEY without a section (no dot, e.g. RAY_worker_niceness=0) is an
    environment variable of the job's processes, the rest `--set` items (e.g. debug.pinned_slabs=0).
    Environment names are case-sensitive, so they are passed on as written."""
    env = dict(item.split("=", 1) for item in items if "." not in item.split("=", 1)[0])
    moved = sorted(set(env) & set(DEBUG_SETTINGS))
    if moved:
        raise ValueError(
            ", ".join(f"{k} is the job's setting {DEBUG_SETTINGS[k]}: pass {DEBUG_SETTINGS[k]}=..." for k in moved)
        )
    return [item for item in items if "." in item.split("=", 1)[0]], env

"""The `--set` items a benchmark passes to a job, split from those that are environment variables."""

from __future__ import annotations


def split_env(items: list[str]) -> tuple[list[str], dict[str, str]]:
    """(config sets, environment): a KEY without a section (no dot, e.g. RAY_worker_niceness=0 or
    HIDDEN_HARVEST_PINNED_SLABS=0) is an environment variable of the job's processes, the rest `--set` items.
    Environment names are case-sensitive, so they are passed on as written."""
    env = dict(item.split("=", 1) for item in items if "." not in item.split("=", 1)[0])
    return [item for item in items if "." in item.split("=", 1)[0]], env

"""Every environment variable the project reads or sets, who it is for, and what it does.

Settings belong in conf/ (typed, validated, recorded in the manifest). An environment variable is used only where a
config value cannot reach: the one user knob that must hold before any config is read (the model cache), the
plumbing into SGLang's own processes (the hook under patches/ runs there and imports nothing of the project, so it
reads these names itself), the tests' fault injection, and the variables of Ray, AWS and the notebook that the
project reads or sets on the user's behalf. Profiling and benchmark switches are the config's `debug` section, not
variables. `tests/unit/test_envs.py` checks that every `HIDDEN_HARVEST_*` name in the code is listed here.

This module imports nothing of the project, so every layer may read it.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Literal

Audience = Literal["user", "server", "test", "third-party"]


@dataclass(frozen=True)
class EnvVar:
    name: str
    audience: Audience  # user: set by users; server: set by the engine for SGLang's processes; test: tests only
    doc: str

    def get(self, default: str | None = None) -> str | None:
        return os.environ.get(self.name, default)


# For users.
CACHE = EnvVar(
    "HIDDEN_HARVEST_CACHE",
    "user",
    "Where the default model is converted and cached (default ~/.cache/hidden-harvest). Read before any config, "
    "so `make install` and the job agree on it.",
)

# Set by actors/sglang/server.py in the server's environment, read by the hook in patches/sglang/<version>/sitedir.
DUMP_DIR = EnvVar(
    "HIDDEN_HARVEST_DUMP_DIR", "server", "The actor's private dump dir; set, it installs the capture hook."
)
RID_PREFIX = EnvVar(
    "HIDDEN_HARVEST_RID_PREFIX", "server", "Request ids the hook captures; health checks and others are skipped."
)
FINAL = EnvVar("HIDDEN_HARVEST_FINAL", "server", "pre_norm or post_norm: which side of the final norm is captured.")
LAYOUT = EnvVar("HIDDEN_HARVEST_LAYOUT", "server", "How the hook publishes a capture: byte planes or fp8.")
AUX_LAYERS = EnvVar("HIDDEN_HARVEST_AUX_LAYERS", "server", "Comma-separated aux layer ids the hook stores.")
PARENT_PID = EnvVar(
    "HIDDEN_HARVEST_PARENT_PID",
    "server",
    "The actor's pid: the server's watchdog ends the server when it dies (a force-killed actor runs no teardown).",
)
LOOPBACK = EnvVar(
    "HIDDEN_HARVEST_LOOPBACK", "server", "Keeps torch.distributed's rendezvous store on 127.0.0.1 inside the server."
)

# Fault injection inside the hook, for tests only (patches/sglang/<version>/sitedir/hidden_harvest_faults.py).
FAULTS = EnvVar(
    "HIDDEN_HARVEST_FAULTS", "test", 'Faults and their probability per capture, e.g. "nan:0.1,missing:0.2".'
)
FAULT_LOG = EnvVar("HIDDEN_HARVEST_FAULT_LOG", "test", "A JSONL file where every injected fault is recorded.")
FAULT_SEED = EnvVar("HIDDEN_HARVEST_FAULT_SEED", "test", "Seed of the injection's random draws (default 0).")
FAULT_LATE_S = EnvVar("HIDDEN_HARVEST_FAULT_LATE_S", "test", "Seconds a `late` fault holds a capture back (default 5).")

# Other projects' variables that the project reads or sets.
RAY_ADDRESS = EnvVar(
    "RAY_ADDRESS", "third-party", "Ray's own: a cluster to join (ray.address in the config wins); read by the CLI."
)
RAY_USAGE_STATS = EnvVar(
    "RAY_USAGE_STATS_ENABLED", "third-party", "Ray's own; the CLI sets 0 unless the user set it: no usage reports."
)
RAY_PROGRESS_INTERVAL = EnvVar(
    "RAY_DATA_NON_TTY_PROGRESS_LOG_INTERVAL",
    "third-party",
    "Ray Data's own; the CLI sets it from progress.interval_s unless the user set it.",
)
AWS_SECRETS = (
    EnvVar("AWS_ACCESS_KEY_ID", "third-party", "AWS's own; its value is blanked wherever the project logs text."),
    EnvVar("AWS_SECRET_ACCESS_KEY", "third-party", "AWS's own; its value is blanked wherever the project logs text."),
    EnvVar("AWS_SESSION_TOKEN", "third-party", "AWS's own; its value is blanked wherever the project logs text."),
)
NOTEBOOK_OUTPUT = EnvVar(
    "HARVEST_OUTPUT", "user", "The output notebooks/inspect_shards.ipynb looks at (a local path or s3:// URL)."
)

ALL: tuple[EnvVar, ...] = (
    CACHE,
    DUMP_DIR,
    RID_PREFIX,
    FINAL,
    LAYOUT,
    AUX_LAYERS,
    PARENT_PID,
    LOOPBACK,
    FAULTS,
    FAULT_LOG,
    FAULT_SEED,
    FAULT_LATE_S,
    RAY_ADDRESS,
    RAY_USAGE_STATS,
    RAY_PROGRESS_INTERVAL,
    *AWS_SECRETS,
    NOTEBOOK_OUTPUT,
)

# Names the project once read and reads no more, with the setting that took their place: a benchmark refuses them
# (bench/job_sets.py), so a switch passed the old way is not silently ignored.
RETIRED: dict[str, str] = {
    "HIDDEN_HARVEST_FORWARD_LOG": "debug.forward_log",
    "HIDDEN_HARVEST_PINNED_SLABS": "debug.pinned_slabs",
}

"""Checks that refuse a run that cannot work, before anything is extracted, with one message that says why.

A model directory that is missing or unreadable, an aux layer the model does not have, a tensor-parallel
size no node can hold (Ray would wait for those GPUs for ever), an output that cannot be written: each is
a PreflightError, which the CLI prints as one line without a traceback.
"""

from __future__ import annotations

import logging

from conf import HarvestConfig
from pipeline.driver.plan import Plan, PlanError, make_plan
from pipeline.format.lock import OutputLocked, RunLock
from pipeline.format.storage import Store, redact

logger = logging.getLogger(__name__)


class PreflightError(RuntimeError):
    """The run cannot work as configured; the message says what to change."""


def plan_or_refuse(cfg: HarvestConfig, gpus_available: float) -> Plan:
    try:
        return make_plan(cfg, gpus_available)
    except PlanError as e:
        raise PreflightError(str(e)) from None  # already says which setting and what to do


def check_gpus(cfg: HarvestConfig, cuda: bool, gpus_per_node: list[float]) -> None:
    """One engine replica's tp_size GPUs must fit on one node."""
    if not cuda:
        return
    largest = max(gpus_per_node, default=0)
    if cfg.engine.tp_size > largest:
        raise PreflightError(
            f"engine.tp_size={cfg.engine.tp_size} needs {cfg.engine.tp_size} GPUs on one node, but the largest node of "
            f"this Ray cluster has {largest:g} (nodes: {[int(g) for g in gpus_per_node]}). Lower engine.tp_size, "
            "or set engine.device=cpu to run without GPUs."
        )


def cluster_gpus_per_node() -> list[float]:
    import ray

    return [n["Resources"].get("GPU", 0.0) for n in ray.nodes() if n.get("Alive")]


def lock_output(store: Store) -> RunLock:
    """Take the output's run lock; writing it is also the check that the output is reachable and writable."""
    try:
        return RunLock(store).acquire()
    except OutputLocked:
        raise
    except Exception as e:  # noqa: BLE001 -- whatever the storage raises, the user needs the one line
        raise PreflightError(
            f"output.path {store.display()} cannot be written: {type(e).__name__}: {redact(' '.join(str(e).split()))[:300]}"
        ) from None

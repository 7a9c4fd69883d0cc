"""`harvest audit`: recompute committed samples in float32 and compare them with what was stored.

The reference is transformers (actors/hf/reference.py) run in float32 on the model the manifest
names, sharing no code with the SGLang capture path (server, hook, dump, validation). For each audited
sample and each stored layer (every aux layer, then the final state) it judges the stored bf16 states
against float32 by the yardstick of a bf16 forward of the same tokens (pipeline/tools/fidelity.py): a healthy
capture is about as far from float32 as any bf16 forward is, damage is many times further. The report
gives each layer's distances, the rule and its factors, cosines for the reader, and names the worst.

What it catches: a sample paired with another sample's states, a shifted or wrong layer, a truncated or
offset sequence, corrupted bytes that still decode, a different model. What it cannot: bf16 rounding
and the drift it accumulates over the layers, which it is built to tolerate.

The reference lives in reference.py, the verdicts and the report in judge.py, the command itself in run.py.
"""

from pipeline.tools.audit.judge import RULE_WHY, AuditReport, LayerResult, compare, judge_sample
from pipeline.tools.audit.reference import REFERENCE_RUNS, Reference
from pipeline.tools.audit.run import (
    AUDIT_REPORT,
    DEFAULT_SAMPLES,
    AuditError,
    audit,
    pick_samples,
    quantization_bounds,
    resolve_model_dir,
)

__all__ = [
    "AUDIT_REPORT",
    "DEFAULT_SAMPLES",
    "REFERENCE_RUNS",
    "RULE_WHY",
    "AuditError",
    "AuditReport",
    "LayerResult",
    "Reference",
    "audit",
    "compare",
    "judge_sample",
    "pick_samples",
    "quantization_bounds",
    "resolve_model_dir",
]

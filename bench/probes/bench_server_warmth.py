"""How a CPU SGLang capture server's rate depends on what it has run before: new prompts against repeated ones.

  python bench/probes/bench_server_warmth.py [--prompts 150] [--windows 8,16] [--malloc tuned,glibc] [--repeats 1]
                                     [--out bench/results/server_warmth_cpu.json]

For each window, a fresh capturing engine (actors/sglang/engine.py, its warm-up included) captures, in turn:
set A (log-uniform 48-1,024 tokens, as bench_throughput's short set), set B (the same lengths' distribution,
other prompts), and set A again. A job sees every prompt once, so its server runs at the rate of new prompts,
while the plain baseline sweeps its windows over the same prompts: if repeated prompts ran faster, that
baseline would be one no job could reach. It also shows whether a fresh engine's first pass is slower than its
later ones (the engine's warm-up is there to make it not).

--onednn: the server logs oneDNN's primitive creation (ONEDNN_VERBOSE=profile_create), and each pass records
how many matmul primitives it created and the milliseconds that took: oneDNN builds a primitive for each new
matmul shape, and a prefill batch's row count is its token count, which a new prompt mix rarely repeats.

--malloc: the server's glibc malloc settings, each on its own fresh engine: `tuned` (the engine's default on the
CPU, actors/sglang/server.py CPU_MALLOC_ENV) and `glibc` (glibc's own defaults: the spec sets MALLOC_PERTURB_=0,
which changes nothing but keeps the engine's settings out). With --repeats R the modes alternate R times.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import shlex
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from actors.sglang.engine import SGLangEngine  # noqa: E402
from bench.bench_throughput import machine  # noqa: E402
from pipeline.driver.plan import default_aux_layers  # noqa: E402
from pipeline.intake.model import num_hidden_layers, prepare_default_model  # noqa: E402


def prompts(n: int, seed: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    lengths = [int(round(math.exp(rng.uniform(math.log(48), math.log(1024))))) for _ in range(n)]
    return [rng.integers(100, 49_000, size=k).tolist() for k in lengths]


# The server's environment for each --malloc mode: {} leaves the engine's own choice (tuned on the CPU).
MALLOC = {"tuned": {}, "glibc": {"MALLOC_PERTURB_": "0"}}


def onednn_creations(log: Path, offset: int) -> tuple[dict, int]:
    """Primitive creations oneDNN logged after byte `offset` of the server's log: count and milliseconds."""
    with log.open("rb") as f:
        f.seek(offset)
        text = f.read().decode(errors="replace")
    ms = [float(x.rsplit(",", 1)[1]) for x in text.splitlines() if ",create:cache_miss," in x]
    return {"primitives_created": len(ms), "create_ms": round(sum(ms), 1)}, offset + len(text.encode())


def passes(spec: dict, window: int, sets: dict, label: str) -> list[dict]:
    """Sets A, B, A through one fresh engine; tok/s of each pass."""
    rates = []
    onednn = spec.get("env", {}).get("ONEDNN_VERBOSE") == "profile_create"
    with SGLangEngine(spec, max_in_flight=window, request_timeout_s=600, dump_timeout_s=30) as engine:
        log = engine.server._log_path
        offset = log.stat().st_size
        for name in ("A", "B", "A"):
            t0 = time.perf_counter()
            res = engine.capture([(f"{name}{len(rates)}-{i}", ids) for i, ids in enumerate(sets[name])])
            took = time.perf_counter() - t0
            for r in res.values():
                assert r.error is None, r.error
                r.capture.release()
            rates.append({"set": name, "tok_s": round(sum(map(len, sets[name])) / took, 1), "seconds": round(took, 2)})
            if onednn:
                created, offset = onednn_creations(log, offset)
                rates[-1].update(created)
            print(f"{label}, set {name}: {rates[-1]}", flush=True)
    return rates


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompts", type=int, default=150)
    ap.add_argument("--windows", default="8,16")
    ap.add_argument("--malloc", default="tuned", help="comma-separated: tuned (the engine's default), glibc")
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--onednn", action="store_true", help="count oneDNN's primitive creations in each pass")
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "server_warmth_cpu.json")
    args = ap.parse_args()
    model = prepare_default_model()
    spec = {
        "model_dir": str(model),
        "aux_layers": default_aux_layers(num_hidden_layers(model)),
        "final_layer": "pre_norm",
        "cpu": True,
        "cpu_threads": 2,
        "extra_flags": (),
    }
    sets = {"A": prompts(args.prompts, 0), "B": prompts(args.prompts, 1)}
    modes = args.malloc.split(",")
    if set(modes) - set(MALLOC):
        sys.exit(f"--malloc: {', '.join(MALLOC)}")
    runs: dict = {}
    for window in [int(w) for w in args.windows.split(",")]:
        for _ in range(args.repeats):
            for mode in modes:
                env = MALLOC[mode] | ({"ONEDNN_VERBOSE": "profile_create"} if args.onednn else {})
                rates = passes(dict(spec, env=env), window, sets, f"window {window}, malloc {mode}")
                runs.setdefault(mode, {}).setdefault(str(window), []).append(rates)
    result = {
        "benchmark": "a CPU capture server on new prompts against prompts it has run (after the engine's warm-up)",
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d"),
        "command": shlex.join(["python", "bench/probes/bench_server_warmth.py"] + sys.argv[1:]),
        "machine": machine(),
        "prompts_per_set": args.prompts,
        "tokens": {k: sum(map(len, v)) for k, v in sets.items()},
        # malloc mode -> window -> one list of passes (A, B, A) per repeat
        "passes_by_malloc_and_window": runs,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()

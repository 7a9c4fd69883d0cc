"""The whole job on GPUs against the bare engine, in one run (the hf engine: SGLang does not run everywhere).

  python bench/bench_job_gpu.py --work DIR --tokenizer TOKENIZER_DIR [--shape 8b|qwen3-8b|tiny] [--prompts 1000]
                                [--min-len 128] [--max-len 2048] [--lengths uniform|loguniform]
                                [--batch-tokens 8192,16384,32768] [--passes 2]
                                [--actors 1,2,1@TMPFS_DIR] [--disk-test-gb 8] [--variant NAME:KEY=VAL,...]
                                [--device cuda|cpu] [--engine-defaults] [--replay] [--gil-profile PY_SPY]
                                [--out bench/results/job_gpu.json]

1. A random-init model of the requested shape (8b: Llama-3-8B, H=4096, 32 layers, GQA 32/8, MLP 14336;
   qwen3-8b: Qwen3-8B, H=4096, 36 layers, GQA 32/8, MLP 12288, QK-norm) with the default model's tokenizer,
   saved as a normal HF model directory (bf16 safetensors).
2. N pre-tokenized prompts, lengths uniform (or log-uniform: most prompts short, most tokens in long ones) in
   [min-len, max-len] (fixed seed), written as `{"id", "input_ids"}`.
3. baselines, each the best of --passes passes per max_batch_tokens; the better of the two is the baseline:
   a plain transformers loop (bench/bare_hf.plain_loop: length-sorted batches, right-padded, one forward
   after another; --no-plain skips it) and
   bare: bench/bare_hf.BareHFEngine (the hf engine, nothing kept) on the same prompts, every prompt submitted at once (so
   its batches are as well sorted as they can be), after a warm-up, for each max_batch_tokens and each setting
   (packed forwards where the model packs; padded rows at the engine's fill floor and at the measured one),
   best of --passes passes over the same prompts; the
   baseline is the best of all. Beside each rate: the device's
   microseconds per padded token (its forwards' own clock), the number to set against the job's.
4. job: `python -m pipeline.cli run` with engine.name=hf, the best max_batch_tokens, num_actors = each of
   --actors (one GPU each; `N@DIR` puts that run's output under DIR instead of --work), the output on local
   disk; then `harvest verify` on it; the output is then removed. Scaling compares runs with the same DIR.
5. --disk-test-gb: each output directory's own sustained write rate (4 writers, fdatasync every 256 MB), so a
   job that waits on its disk can be told from one that is slow itself.
job ÷ bare uses the job's rate after engine start (manifest last_run.tokens_per_second_after_engine_start:
committed tokens from the moment the first actor's engine was up to the last commit; Ray and model start-up
excluded, every batch included). The end-to-end and steady (first to last commit) rates are recorded too;
the steady rate misleads when a few large batches are all in flight at once (they all land at the end).
Each run's `window` splits that span per actor with the engine's own clock (before the first forward, the
forwards' span, after the last results); `--variant NAME:KEY=VAL,...` adds one-actor runs with other settings
(a KEY without a section, e.g. RAY_worker_niceness, is an environment variable of that job's processes).
6. --replay: the first job's forwards (their exact batches, from the engine's forward log) run again on the
   bare engine in this process: the same shapes without the actor around them, so a per-token gap can be
   told apart into the job's batch composition and what the actor's process does to its forwards.
7. --gil-profile PY_SPY: py-spy samples which thread of the first job's actor holds the interpreter lock
   while its forwards run (`--gil --nonblocking`: the actor is never paused); the share of wall time per
   role (forward thread, finisher, extractor calls, encoders, Ray) and each role's hottest frames.
8. On CUDA, nvidia-smi samples the SM clock and power draw throughout: each bare pass and each job's forwards
   get their medians (a job whose kernels all run slower, not one that waits, shows a lower clock).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import re
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.gpu_clock import GpuClock  # noqa: E402 - after the path that makes `bench` importable
from bench.job_sets import split_env  # noqa: E402

SHAPES = {
    "8b": dict(
        hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8
    ),
    "qwen3-8b": dict(
        hidden_size=4096,
        intermediate_size=12288,
        num_hidden_layers=36,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
    ),
    "tiny": dict(
        hidden_size=256, intermediate_size=512, num_hidden_layers=8, num_attention_heads=4, num_key_value_heads=2
    ),
}


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def make_model(work: Path, shape: str, tokenizer: Path, device: str) -> Path:
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

    out = work / f"model-{shape}"
    if (out / "config.json").is_file():
        return out
    tok = AutoTokenizer.from_pretrained(tokenizer)
    config_class, model_class = (
        (Qwen3Config, Qwen3ForCausalLM) if shape.startswith("qwen3") else (LlamaConfig, LlamaForCausalLM)
    )
    cfg = config_class(
        vocab_size=len(tok),
        max_position_embeddings=8192,
        rope_theta=500000.0,
        tie_word_embeddings=False,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        **SHAPES[shape],
    )
    t0 = time.monotonic()
    torch.manual_seed(0)
    with torch.device(device):
        model = model_class(cfg).to(torch.bfloat16)
    model.save_pretrained(out)
    tok.save_pretrained(out)
    del model
    log(
        f"model {shape}: {sum(f.stat().st_size for f in out.glob('*.safetensors')) / 1e9:.1f} GB in {time.monotonic() - t0:.0f}s"
    )
    return out


def prompt_lengths(rng, n: int, lo: int, hi: int, dist: str) -> list[int]:
    """uniform: every length in [lo, hi] alike; loguniform: log-length uniform (most prompts short, most tokens
    in the long ones, as in chat data with a few documents)."""
    import math

    if dist == "loguniform":
        return [int(round(math.exp(rng.uniform(math.log(lo), math.log(hi))))) for _ in range(n)]
    return [int(rng.integers(lo, hi + 1)) for _ in range(n)]


def make_prompts(
    work: Path, n: int, lo: int, hi: int, vocab: int, dist: str = "uniform"
) -> tuple[Path, list[list[int]]]:
    import numpy as np

    rng = np.random.default_rng(1234)
    if dist == "uniform":  # the draws of the runs recorded before log-uniform lengths existed
        prompts = [rng.integers(100, vocab, size=int(rng.integers(lo, hi + 1))).tolist() for _ in range(n)]
    else:
        prompts = [rng.integers(100, vocab, size=k).tolist() for k in prompt_lengths(rng, n, lo, hi, dist)]
    path = work / "prompts.jsonl"
    with path.open("w") as f:
        for i, ids in enumerate(prompts):
            f.write(json.dumps({"id": f"p{i:05d}", "input_ids": ids}) + "\n")
    return path, prompts


def us_per_padded_token(engine_stats: dict) -> float | None:
    """The device's own microseconds per padded token over a run's forwards (first layer to final norm)."""
    dev, padded = engine_stats.get("device_forward_s"), engine_stats.get("padded_tokens")
    return round(1e6 * dev / padded, 2) if dev and padded else None


# The bare engine's settings swept beside max_batch_tokens: packed forwards (where the model packs,
# actors/hf/packing.py; asked for whatever the job's engine.packing), and padded rows at the engine's padded fill
# floor and at the measured one, so the baseline is the bare engine at its best whichever suits it
# (actors/hf/engine.py, CUDA_FILL_FLOOR).
BARE_SETTINGS = (("packed", None), ("padded", None), ("padded", "measured"))


def bare(model_dir: Path, prompts: list[list[int]], sweep: list[int], device: str, passes: int = 1) -> dict:
    from bench.bare_hf import BareHFEngine
    from pipeline.driver.plan import default_aux_layers
    from pipeline.intake.model import num_hidden_layers

    aux = default_aux_layers(num_hidden_layers(model_dir))
    eng = BareHFEngine(str(model_dir), aux, device=device, max_batch_tokens=max(sweep), packing="auto").start()
    tokens = sum(len(p) for p in prompts)
    rates, stats, every, sizes = {}, {}, {}, {}
    try:
        eng.capture([(f"w{i}", p) for i, p in enumerate(prompts[:64])])  # warm-up: kernels, allocator
        default_floor, packs = eng.fill_floor, eng.packed
        for b, (rows, floor) in ((b, s) for b in sweep for s in BARE_SETTINGS):
            if rows == "packed" and not packs:
                continue
            eng.max_batch_tokens = b
            eng.packed = rows == "packed"
            eng.fill_floor = default_floor if floor is None else None  # None on the engine: measured
            setting = f"{b}/packed" if rows == "packed" else f"{b}" if floor is None else f"{b}/fill_floor={floor}"
            sizes[setting] = b
            for k in range(passes):  # the same prompts again: the engine at its best, not its first pass
                eng.reset_stats()
                t0, start_unix = time.monotonic(), time.time()
                res = eng.capture([(f"p{i}", p) for i, p in enumerate(prompts)])
                dt = time.monotonic() - t0
                errors = [r.error for r in res.values() if r.error]
                if errors:
                    raise RuntimeError(f"bare run failed: {errors[:3]}")
                s = eng.stats()  # the device's own seconds, to set against the job's (per_actor.engine)
                every.setdefault(setting, []).append(
                    {
                        "tok_s": round(tokens / dt, 1),
                        "us_per_padded_token": us_per_padded_token(s),
                        "device_layer_excess_s": s.get("device_layer_excess_s"),
                        "device_allocator": s.get("device_allocator"),
                        "window_unix": [round(start_unix, 3), round(time.time(), 3)],
                    }
                )
                if tokens / dt > rates.get(setting, 0.0):
                    rates[setting], stats[setting] = tokens / dt, s
                log(
                    f"bare max_batch_tokens={setting} pass {k + 1}: {tokens / dt:,.0f} tok/s ({dt:.1f}s, padding "
                    f"{eng.padded_tokens / max(eng.real_tokens, 1) - 1:.3f}, {us_per_padded_token(s)} us per padded token, "
                    f"layer excess {s.get('device_layer_excess_s')} s)"
                )
    finally:
        eng.close()
    best = max(rates, key=rates.get)
    by_size: dict[str, float] = {}
    for setting, rate in rates.items():
        by_size[str(sizes[setting])] = max(by_size.get(str(sizes[setting]), 0.0), round(rate, 1))
    return {
        "tok_s_by_max_batch_tokens": by_size,
        "tok_s_by_setting": {k: round(v, 1) for k, v in rates.items()},
        "passes": every,
        "best_setting": best,
        "best_max_batch_tokens": sizes[best],
        "tok_s": round(rates[best], 1),
        "us_per_padded_token": us_per_padded_token(stats[best]),
        "tokens": tokens,
        "aux_layers": list(aux),
        "engine": stats[best],
    }


def job_log_lines(output: str, most: int = 20) -> list[str]:
    """The job's own warnings and errors and its start-up line, from its output (logging's format in cli.py)."""
    ours = re.compile(r" (WARNING|ERROR) (harvest|pipeline|actors|conf)[.:]| start-up: ")
    return [line for line in output.splitlines() if ours.search(line)][-most:]


def engine_only(model_dir: Path, prompts: list[list[int]], batch_tokens: int, device: str, aux: list[int]) -> dict:
    """The capturing engine alone, then with the actor's encoding (16 threads, no disk): where time goes."""
    from concurrent.futures import ThreadPoolExecutor, as_completed

    from actors.hf.engine import HFEngine
    from pipeline.format.codec import Codec

    tokens = sum(len(p) for p in prompts)
    out = {}
    codec = Codec()
    with (
        HFEngine(str(model_dir), tuple(aux), device=device, max_batch_tokens=batch_tokens) as eng,
        ThreadPoolExecutor(16) as pool,
    ):
        for r in as_completed([eng.submit(f"w{i}", p) for i, p in enumerate(prompts[:64])]):
            r.result().capture.release()
        for mode in ("capture", "capture+encode"):
            eng.reset_stats()
            t0 = time.monotonic()
            jobs = []
            for f in as_completed([eng.submit(f"p{i}", p) for i, p in enumerate(prompts)]):
                cap = f.result().capture
                if mode == "capture":
                    cap.release()
                else:
                    jobs.append(pool.submit(lambda c: (c.encode(codec), c.release()), cap))
            for j in jobs:
                j.result()
            out[mode] = round(tokens / (time.monotonic() - t0), 1)
            st = eng.stats()
            out[f"{mode} engine"] = st | {"us_per_padded_token": us_per_padded_token(st)}
            log(
                f"engine {mode}: {out[mode]:,.0f} tok/s, {us_per_padded_token(st)} us per padded token, "
                f"layer excess {st.get('device_layer_excess_s')} s, lead under a layer {st.get('lead_under_a_layer')}"
            )
    return out


def disk_rate(root: Path, gb: float, writers: int = 4) -> dict:
    """Sustained write rate into `root`: `writers` threads, fdatasync every 256 MB (as the shard writer does)."""
    from concurrent.futures import ThreadPoolExecutor

    root.mkdir(parents=True, exist_ok=True)
    chunk = os.urandom(1 << 20) * 256  # incompressible, in case the disk compresses
    per = max(1, int(gb * 4 / writers))  # 256 MB chunks per writer

    def write(i: int) -> None:
        path = root / f"disk-test-{i}"
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        try:
            for _ in range(per):
                os.write(fd, chunk)
                os.fdatasync(fd)
        finally:
            os.close(fd)
            path.unlink()

    t0 = time.monotonic()
    with ThreadPoolExecutor(writers) as pool:
        list(pool.map(write, range(writers)))
    dt = time.monotonic() - t0
    total = per * writers * len(chunk)
    log(f"disk {root}: {total / dt / 1e9:.2f} GB/s ({total / 1e9:.1f} GB in {dt:.1f}s, {writers} writers)")
    return {"bytes": total, "seconds": round(dt, 2), "gb_per_s": round(total / dt / 1e9, 3), "writers": writers}


def job(
    work: Path,
    model_dir: Path,
    prompts: Path,
    actors: int,
    batch_tokens: int | None,
    device: str,
    batch_size: int | None,
    batches_per_actor: int | None,
    extra_sets: tuple[str, ...] = (),
    max_tokens: int = 4096,
    forward_log: Path | None = None,
    gil_profile: tuple[str, Path] | None = None,
    verify: bool = True,
    tree: Path = ROOT,
) -> dict:
    """One `harvest run`; a setting passed as None is left to the engine's own default for the device.

    forward_log: each engine's forwards are logged there (debug.forward_log, actors/hf/device_clock.py);
    gil_profile: (py-spy, where its samples go): which actor thread holds the interpreter lock meanwhile;
    tree: the checkout of the project whose code runs the job (bench/bench_job_ab.py runs two on one machine)."""
    out = work / f"out-{actors}"
    out.parent.mkdir(parents=True, exist_ok=True)
    shutil.rmtree(out, ignore_errors=True)
    chosen = {
        "engine.num_actors": actors if actors != 1 else None,
        "engine.max_batch_tokens": batch_tokens,
        "engine.batches_per_actor": batches_per_actor,
        "extract.batch_size": batch_size,
    }
    sets = [
        f"input.path={prompts}",
        f"model.path={model_dir}",
        f"output.path={out}",
        "engine.name=hf",
        f"engine.device={device}",
        *(f"{k}={v}" for k, v in chosen.items() if v is not None),
        f"extract.max_tokens={max_tokens}",
        "progress.interval_s=5",
        *([f"debug.forward_log={forward_log.resolve()}"] if forward_log is not None else []),
        *extra_sets,
    ]
    sets, job_env = split_env(sets)  # a variant's keys without a section are environment variables
    cmd = [sys.executable, "-m", "pipeline.cli", "run", str(tree / "conf" / "default.yaml")] + [
        a for s in sets for a in ("--set", s)
    ]
    env = dict(os.environ) | job_env
    if tree != ROOT:  # its code first, in the driver and in the actors (Ray's workers inherit this environment)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(tree), env.get("PYTHONPATH")) if p)
    if forward_log is not None:
        shutil.rmtree(forward_log, ignore_errors=True)
        forward_log.mkdir(parents=True)
    profiler = None
    if gil_profile is not None and forward_log is not None:
        from bench.gil_profile import GilProfile

        profiler = GilProfile(gil_profile[0], gil_profile[1], forward_log)
        profiler.start()
    t0 = time.monotonic()
    proc = subprocess.run(cmd, cwd=tree, capture_output=True, text=True, env=env)
    wall = time.monotonic() - t0
    gil = profiler.result() if profiler is not None else None
    tail = (proc.stdout + proc.stderr)[-3000:]
    if proc.returncode != 0:
        log(f"job failed ({proc.returncode}):\n{tail}")
        return {"actors": actors, "failed": True, "returncode": proc.returncode, "log_tail": tail}
    manifest = json.loads((out / "manifest.json").read_text())
    lr, totals = manifest["last_run"], manifest["totals"]
    t1 = time.monotonic()
    ver = (
        subprocess.run(
            [sys.executable, "-m", "pipeline.cli", "verify", str(out)], cwd=tree, capture_output=True, text=True
        )
        if verify
        else None
    )
    verify_s = time.monotonic() - t1
    result = {
        "actors": actors,
        "output_root": str(work),
        "window": window(lr),
        "command": shlex.join(["harvest", "run", "conf/default.yaml"] + [a for s in sets for a in ("--set", s)]),
        # From the first engine up to the last commit: every batch, no Ray or model start-up.
        "tok_s": lr["tokens_per_second_after_engine_start"],
        "tok_s_steady": lr["steady_tokens_per_second"],
        "tok_s_end_to_end": lr["tokens_per_second"],
        "per_actor": lr.get("per_actor"),
        "extract_seconds": lr["extract_seconds"],
        "first_result_seconds": lr["first_result_seconds"],
        "wall_seconds": round(wall, 1),
        "samples_ok": totals["samples_ok"],
        "errors": totals["errors"],
        "tokens": totals["tokens"],
        "bytes": totals["bytes"],
        "shards": totals["shards"],
        "exactly_once": totals["samples_ok"] == totals["input_rows"] and totals["accounted"] == totals["input_rows"],
        "verify_passed": None if ver is None else ver.returncode == 0,
        "verify_seconds": round(verify_s, 1),
        "verify_tail": "" if ver is None else ver.stdout[-600:],
        # What the job itself said beyond its figures: its warnings (a dashboard it started without, a
        # config it corrected) and where its start-up went.
        "job_log": job_log_lines(proc.stdout + proc.stderr),
        # Where start-up went, by part (Ray, read and tokenize, actor, engine load and its parts, warm-up).
        "startup": lr.get("startup"),
    }
    engines = [a.get("engine") or {} for a in (lr.get("per_actor") or {}).values()]
    result["us_per_padded_token"] = [us_per_padded_token(e) for e in engines]
    if forward_log is not None:
        result["forwards"] = forward_summary(read_forward_log(forward_log))
    if gil is not None:
        result["gil"] = gil
    log(
        f"job actors={actors} under {work}: {result['tok_s']:,.0f} tok/s after engine start, end to end {result['tok_s_end_to_end']:,.0f}; "
        f"{totals['samples_ok']} ok {totals['errors']} errors; verify {result['verify_passed']}; "
        f"us per padded token {result['us_per_padded_token']}; layer excess {[e.get('device_layer_excess_s') for e in engines]} s"
    )
    shutil.rmtree(out, ignore_errors=True)
    return result


def read_forward_log(log_dir: Path) -> list[dict]:
    """The forwards an engine logged after its last counter reset (its warm-up comes before it)."""
    rows: list[dict] = []
    for path in sorted(log_dir.glob("forwards-*.jsonl")):
        for line in path.read_text().splitlines():
            rec = json.loads(line)
            if rec.get("reset"):
                rows = [r for r in rows if r.get("_file") != path.name]
            else:
                rows.append(rec | {"_file": path.name})
    return rows


def forward_summary(rows: list[dict]) -> dict:
    """Device seconds, padded tokens and where the device waited, over logged forwards; by forward size too."""
    if not rows:
        return {}

    def agg(part: list[dict]) -> dict:
        padded = sum(r["rows"] * r["t"] for r in part)
        dev = sum(r["device_ms"] for r in part) / 1000
        return {
            "forwards": len(part),
            "padded_tokens": padded,
            "real_tokens": sum(sum(r["lengths"]) for r in part),
            "device_s": round(dev, 3),
            "us_per_padded_token": round(1e6 * dev / max(padded, 1), 2),
            "layer_excess_s": round(sum(r["layer_excess_ms"] for r in part) / 1000, 3),
            "host_launch_s": round(sum(r["host_ms"] for r in part) / 1000, 3),
            "lead_under_a_layer": sum(r["lead_under_a_layer"] for r in part),
            "forwards_with_lead_under_a_layer": sum(1 for r in part if r["lead_under_a_layer"]),
        }

    out = agg(rows)
    # Which layers waited (the engine logs those a millisecond or more beyond their forward's median): the
    # first layer waits on the forward's own start, a layer deep in the stack on a stall of the launching thread.
    by_layer: dict[int, float] = {}
    for r in rows:
        for i, ms in r.get("slow_layers", []):
            by_layer[i] = by_layer.get(i, 0.0) + ms
    if by_layer:
        top = sorted(by_layer.items(), key=lambda kv: -kv[1])[:8]
        out["slow_layers_ms"] = {
            "first_layer": round(by_layer.get(0, 0.0), 1),
            "other_layers": round(sum(v for k, v in by_layer.items() if k), 1),
            "forwards_with_a_slow_layer": sum(1 for r in rows if r.get("slow_layers")),
            "top": {str(k): round(v, 1) for k, v in top},
        }
    # Forwards whose host launch overlapped a batch's pinned allocation on the finisher thread, and the rest:
    # where the allocation holds up the launches, the first group's layers wait longer.
    allocs = [
        (r["pin_alloc_unix"], r["pin_alloc_unix"] + r["pin_alloc_ms"] / 1000) for r in rows if r.get("pin_alloc_ms")
    ]

    def overlaps(r: dict) -> bool:
        a, b = r["host_start_unix"], r["host_start_unix"] + r["host_ms"] / 1000
        return any(x < b and y > a for x, y in allocs)

    if allocs and all("host_start_unix" in r for r in rows):
        out["launch_overlapped_pin_alloc"] = agg([r for r in rows if overlaps(r)]) if any(map(overlaps, rows)) else {}
        out["launch_clear_of_pin_alloc"] = agg([r for r in rows if not overlaps(r)])
    sizes = {"<4k": [], "4k-8k": [], "8k-12k": [], ">=12k": []}
    for r in rows:
        n = r["rows"] * r["t"]
        sizes["<4k" if n < 4096 else "4k-8k" if n < 8192 else "8k-12k" if n < 12288 else ">=12k"].append(r)
    out["by_padded_tokens"] = {k: agg(v) for k, v in sizes.items() if v}
    return out


def replay(model_dir: Path, rows: list[dict], device: str, aux: list[int], passes: int = 1) -> dict:
    """The logged forwards again, batch for batch, on the bare engine in this process."""
    import numpy as np

    from bench.bare_hf import BareHFEngine

    groups = [r["lengths"] for r in rows]

    class Replay(BareHFEngine):
        def take(self, pool):
            if not any(r.key.startswith("f") for r in pool):  # the engine's own warm-up, before the replay
                return super().take(pool)
            # The next logged forward's requests, as the job's engine took them.
            want = f"f{self.next_group}-"
            batch = [r for r in pool if r.key.startswith(want)]
            pool[:] = [r for r in pool if not r.key.startswith(want)]
            self.next_group += 1
            return sorted(batch, key=lambda r: -len(r.ids))

    rng = np.random.default_rng(7)
    max_tokens = max(r["rows"] * r["t"] for r in rows)
    eng = Replay(str(model_dir), tuple(aux), device=device, max_batch_tokens=max_tokens).start()
    out = []
    try:
        for _ in range(passes):
            eng.reset_stats()
            eng.next_group = 0
            futures = eng.submit_together(  # all queued before the worker takes the first
                [
                    (f"f{j}-{i}", rng.integers(100, eng.vocab_size, size=n).tolist())
                    for j, g in enumerate(groups)
                    for i, n in enumerate(g)
                ]
            )
            for f in futures:
                f.result()
            s = eng.stats()
            out.append(
                {
                    "forwards": s["forwards"],
                    "padded_tokens": s["padded_tokens"],
                    "device_forward_s": s.get("device_forward_s"),
                    "us_per_padded_token": us_per_padded_token(s),
                    "layer_excess_s": s.get("device_layer_excess_s"),
                    "lead_under_a_layer": s.get("lead_under_a_layer"),
                }
            )
            log(f"replay of the job's {len(groups)} forwards: {out[-1]}")
    finally:
        eng.close()
    return {"passes": out}


def _since(later: float | None, earlier: float | None) -> float | None:
    return None if later is None or earlier is None else round(later - earlier, 3)


def window(last_run: dict) -> dict:
    """Where the rate's window (first engine up -> last commit) went, per actor, from the engine's own clock:
    waiting for the first batch, the span from the first forward to the last results, and what came after
    (the last shard's encoding and commit, and Ray returning its rows); the span's idle seconds are those
    the forward thread had no request."""
    ready, end = last_run.get("engines_ready_unix"), last_run.get("last_result_unix")
    out = {}
    for actor, a in (last_run.get("per_actor") or {}).items():
        e = a.get("engine") or {}
        first, last = e.get("first_forward_unix"), e.get("last_done_unix")
        if None in (ready, end, first, last):
            continue
        out[actor] = {
            "before_first_forward_s": round(first - ready, 3),
            "device_span_s": round(last - first, 3),
            "idle_in_span_s": e.get("idle_s"),
            "after_last_results_s": round(end - last, 3),
            # ...of which the actor's last encoding and commit, then Ray returning the rows to the driver.
            "last_commit_after_results_s": _since(e.get("batch_committed_unix"), last),
            # ...the last commit split: its batch's last capture back, its encoders done, its files committed.
            "last_batch_captured_after_results_s": _since(e.get("batch_captured_unix"), last),
            "last_batch_encoded_after_results_s": _since(e.get("batch_encoded_unix"), last),
            "last_batch_commit_s": _since(e.get("batch_committed_unix"), e.get("batch_encoded_unix")),
            "rows_to_driver_s": _since(end, e.get("batch_committed_unix")),
            # The actor's shard I/O over the run (seconds summed over its batch threads, encoded bytes).
            "shard_io": e.get("shard_io"),
            "padding": round(e["padded_tokens"] / max(e["real_tokens"], 1) - 1, 4),
            "forwards": e.get("forwards"),
            "us_per_padded_token": us_per_padded_token(e),
            "device_layer_excess_s": e.get("device_layer_excess_s"),
            "lead_under_a_layer": e.get("lead_under_a_layer"),
        }
    return out


def start_run(args: argparse.Namespace, benchmark: str) -> tuple[Path, Path, list[list[int]], dict]:
    """The model and prompts under --work (made once), and a result's header: what ran, where, when, on what."""
    args.work.mkdir(parents=True, exist_ok=True)
    machine = "cpu"
    if args.device == "cuda":
        import torch

        machine = f"{torch.cuda.device_count()} x {torch.cuda.get_device_name(0)}"
    model_dir = make_model(args.work, args.shape, args.tokenizer, args.device)
    vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    prompts_path, prompts = make_prompts(args.work, args.prompts, args.min_len, args.max_len, vocab, args.lengths)
    header = {
        "benchmark": benchmark,
        "machine": machine,
        "cpu_cores": os.cpu_count(),
        "python": platform.python_version(),
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d"),
        "command": shlex.join(["python", f"bench/{Path(sys.argv[0]).name}"] + sys.argv[1:]),
        "shape": args.shape,
        "prompts": {
            "count": args.prompts,
            "min_len": args.min_len,
            "max_len": args.max_len,
            "lengths": args.lengths,
            "tokens": sum(map(len, prompts)),
        },
    }
    return model_dir, prompts_path, prompts, header


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--work", type=Path, required=True)
    ap.add_argument("--tokenizer", type=Path, required=True)
    ap.add_argument("--shape", choices=sorted(SHAPES), default="8b")
    ap.add_argument("--prompts", type=int, default=1000)
    ap.add_argument("--min-len", type=int, default=128)
    ap.add_argument("--max-len", type=int, default=2048)
    ap.add_argument("--lengths", choices=("uniform", "loguniform"), default="uniform")
    ap.add_argument("--passes", type=int, default=2, help="bare engine: best of this many passes per max_batch_tokens")
    ap.add_argument("--replay", action="store_true", help="replay the first job's forwards on the bare engine")
    ap.add_argument("--gil-profile", metavar="PY_SPY", help="py-spy: which actor thread holds the GIL (first job)")
    ap.add_argument("--no-verify", action="store_true", help="skip harvest verify after each job")
    ap.add_argument("--no-plain", action="store_true", help="skip the plain transformers loop baseline")
    ap.add_argument("--batch-tokens", default="8192,16384,32768")
    # Unset: the hf engine's own defaults for the device (conf/schema.py HFEngineConfig: on a GPU 16 batches
    # of 128, whose pool it fills each forward from).
    ap.add_argument("--batch-size", type=int, help="samples per job batch (one shard); default: the engine's")
    ap.add_argument("--batches-per-actor", type=int, help="default: the engine's")
    ap.add_argument(
        "--engine-defaults",
        action="store_true",
        help="the job runs with the engine's default max_batch_tokens instead of the bare engine's best",
    )
    ap.add_argument("--engine-only", action="store_true", help="also time the capturing engine alone and with encoding")
    ap.add_argument(
        "--actors", default="1", help="runs: N or N@DIR (that run's output under DIR), comma separated; none: no job"
    )
    ap.add_argument("--disk-test-gb", type=float, default=0.0, help="first measure each output directory's write rate")
    ap.add_argument(
        "--variant",
        action="append",
        default=[],
        metavar="NAME:KEY=VAL[,KEY=VAL]",
        help="one more one-actor run under the first run's directory with these config overrides",
    )
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "job_gpu.json")
    args = ap.parse_args()

    model_dir, prompts_path, prompts, result = start_run(
        args, "whole job (Ray Data, hf engine actors, validation, committed shards, verify) vs bare engine prefill"
    )
    result["model"] = json.loads((model_dir / "config.json").read_text()) | {"weights": "random init"}
    result["job"] = []

    clock = GpuClock(args.out.parent / "gpu_clock.csv").start() if args.device == "cuda" else None

    def clocks() -> None:
        """The GPU's clock and power while the bare engine's passes and each job's forwards ran."""
        if clock is None:
            return
        for passes in result.get("bare", {}).get("passes", {}).values():
            for p in passes:
                p["gpu"] = clock.window(*p["window_unix"])
        for r in result["job"]:
            for a in (r.get("per_actor") or {}).values():
                e = a.get("engine") or {}
                if e.get("first_forward_unix") and e.get("last_done_unix"):
                    a["gpu"] = clock.window(e["first_forward_unix"], e["last_done_unix"])

    def save() -> None:  # after every stage: a run cut short still leaves what it measured
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=2) + "\n")

    runs = [
        (int(a.split("@")[0]), Path(a.split("@")[1]) if "@" in a else args.work, "", ())
        for a in args.actors.split(",")
        if a != "none"
    ]
    for v in args.variant:
        name, _, sets = v.partition(":")
        runs.append((1, runs[0][1] if runs else args.work, name, tuple(sets.split(","))))
    if args.disk_test_gb:
        result["disk"] = {str(root): disk_rate(root, args.disk_test_gb) for root in dict.fromkeys(r[1] for r in runs)}
        save()
    sweep = [int(b) for b in args.batch_tokens.split(",")]
    result["bare"] = base = bare(model_dir, prompts, sweep, args.device, args.passes)
    save()
    if not args.no_plain:
        from bench.bare_hf import plain_loop

        result["plain"] = {}
        for b in sweep:
            result["plain"][str(b)] = p = plain_loop(str(model_dir), prompts, b, args.device, args.passes)
            log(f"plain transformers loop, {b} tokens a batch: {p['passes_tok_s']} tok/s, padding {p['padding']}")
        save()
    plain_best = max((p["tok_s"] for p in result.get("plain", {}).values()), default=0.0)
    # The baseline is the better of the two plain engines: the bare hf engine and the plain loop.
    baseline = max(base["tok_s"], plain_best)
    result["baseline"] = {
        "tok_s": baseline,
        "engine": "bare hf engine" if baseline == base["tok_s"] else "plain transformers loop",
    }
    if args.engine_only:
        result["engine_only"] = engine_only(
            model_dir, prompts, base["best_max_batch_tokens"], args.device, base["aux_layers"]
        )
        save()
    for n, (actors, root, variant, extra) in enumerate(runs):
        batch_tokens = None if args.engine_defaults else base["best_max_batch_tokens"]
        log_dir = args.work / f"forward-log-{n}"
        r = job(
            root,
            model_dir,
            prompts_path,
            actors,
            batch_tokens,
            args.device,
            args.batch_size,
            args.batches_per_actor,
            extra,
            max_tokens=max(4096, args.max_len),
            forward_log=log_dir,
            gil_profile=(args.gil_profile, args.out.parent / "gil_profile.txt")
            if args.gil_profile and n == 0
            else None,
            verify=not args.no_verify,
        )
        if args.replay and n == 0 and not r.get("failed"):
            logged = read_forward_log(log_dir)
            try:
                r["replay"] = (
                    replay(model_dir, logged, args.device, base["aux_layers"])
                    if logged
                    else {"error": "the job's engine logged no forward (its log needs CUDA)"}
                )
            except Exception as e:  # noqa: BLE001 - the job's own numbers are kept either way
                r["replay"] = {"error": f"{type(e).__name__}: {e}"}
        if variant:
            r["variant"] = variant
        if not r.get("failed"):
            r["ratio_vs_bare"] = round(r["tok_s"] / base["tok_s"], 3)
            r["ratio_vs_baseline"] = round(r["tok_s"] / baseline, 3)
            if plain_best:
                r["ratio_vs_plain_loop"] = round(r["tok_s"] / plain_best, 3)
            r["bare_us_per_padded_token"] = base["us_per_padded_token"]
            r["ratio_vs_bare_end_to_end"] = round(r["tok_s_end_to_end"] / base["tok_s"], 3)
            same_root = [
                x
                for x in result["job"] + [r]
                if x.get("output_root") == str(root) and not x.get("failed") and not x.get("variant")
            ]
            one = next((x for x in same_root if x["actors"] == 1), None)
            if one and not variant:
                r["scaling"] = round(r["tok_s"] / one["tok_s"], 3)
        result["job"].append(r)
        save()
    if clock is not None:
        clock.stop()
        clocks()
        save()
    log(f"wrote {args.out}")
    print(
        json.dumps(
            {
                "bare_tok_s": base["tok_s"],
                "plain_loop_tok_s": plain_best or None,
                "baseline_tok_s": baseline,
                "job": [
                    {
                        k: r.get(k)
                        for k in (
                            "actors",
                            "variant",
                            "output_root",
                            "tok_s",
                            "ratio_vs_bare",
                            "ratio_vs_baseline",
                            "us_per_padded_token",
                            "scaling",
                            "verify_passed",
                            "exactly_once",
                        )
                    }
                    for r in result["job"]
                ],
            }
        )
    )


if __name__ == "__main__":
    main()

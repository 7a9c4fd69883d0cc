"""Throughput of the job against a plain SGLang server at its best concurrency, in one run.

  python bench/bench_throughput.py [--config conf/default.yaml] [--repeats R] [--limit N]
                                   [--short-only | --shipped-only] [--job-set SECTION.KEY=VALUE ...]
                                   [--plain-flags "--mem-fraction-static 0.2"] [--dtype float32]
                                   [--variant NAME:SECTION.KEY=VALUE,...] [--layers N]
                                   [--out bench/results/throughput_cpu.json]

Two prompt sets, each measured on the same samples:
  shipped: the config's input, tokenized as the job does (pipeline.intake.tokenize.Tokenize).
  short:   N short pre-tokenized prompts (48..1024 tokens log-uniform, median ~220; fixed seed), windows cut from the token stream
           of the shipped conversations' text, written as `{"id", "input_ids"}` rows to a temp JSONL.
For each set:
  plain: a stock `sglang.launch_server` (bench/plain_sglang.py: CPU mode and radix cache off, plus
         --plain-flags), a warm-up, then the in-flight window swept over --windows (4,8,16,32; on a 2-core AVX2 CPU
         windows 4 and 8 took turns as the best between runs, throughput_cpu_*_avx2.json) with max_new_tokens=1;
         the baseline is the best window. (Until 2026-12 this was the project's own ServerSpec(capture=False),
         which is not what a user would start.)
  job:   `python -m pipeline.cli run <config>` with only input.path/output.path set (plus --job-set),
         read from manifest.json's last_run: the rate from the moment every engine was up to the last
         result (tokens_per_second_after_engine_start), and end to end over extraction.
--dtype D runs both in D (the plain server's --dtype; the job's engine.server_flags), for a CPU whose bf16
matmul is slow (no avx512_bf16/amx), where either would otherwise be measured at its worst.
ratio_vs_plain = job after engine start / best plain; ratio_vs_plain_end_to_end uses the end-to-end rate
(actor and server start-up included). With --repeats R the plain sweep and the job alternate R times (each
sweep on a fresh server), every figure is the median of R, and each repeat's own ratio is kept
(ratio_vs_plain_per_repeat): a 2-core machine's speed drifts between passes. --variant NAME:K=V,... runs
another job after the default one in every repeat (e.g. `idle_off:ray.idle_daemons=off`), summarized the same
way under the set's `variants`. A KEY without a section is an environment variable of that job's processes
(e.g. `workers0:RAY_worker_niceness=0`).
--layers N runs both on the config's model cut to its first N decoder layers (its own weights, a temporary
copy): per token the server then does ~N/L of the work while every capture, dump and shard stays as large, the
regime of a CPU with native bf16 matmul (~5x faster a token) on a CPU without it.
Each run also records the machine's own speed (bench/timing.machine_gflops: a float32 matmul for 3 s with nothing
else running) before the plain sweep, between it and the job, and after the job: a shared host's speed drifts by
more than the 10 % a ratio is judged by, and a ratio whose phases saw different speeds says so.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import random
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from plain_sglang import USER_FLAGS, plain_sweeps  # noqa: E402
from timing import machine_gflops  # noqa: E402

from actors.cpu import cpu_has_bf16_matmul  # noqa: E402
from actors.sglang.server import ServerSpec  # noqa: E402
from bench.job_sets import split_env  # noqa: E402
from conf import load_config  # noqa: E402
from pipeline.driver.plan import default_aux_layers  # noqa: E402
from pipeline.intake.model import num_hidden_layers, resolve_model  # noqa: E402
from pipeline.intake.normalize import BadRow, parse_line  # noqa: E402
from pipeline.intake.tokenize import Tokenize  # noqa: E402

SHORT_MIN, SHORT_MAX = 48, 1024


def run_job(config: str, input_path: str, job_set: list[str], label: str) -> dict:
    """The job as a user runs it, into a fresh output; figures from manifest.json's last_run."""
    job_set, job_env = split_env(job_set)
    env = dict(os.environ) | job_env
    with tempfile.TemporaryDirectory() as out:
        # Passthrough first: the input and output paths set last always win.
        sets = [*job_set, f"output.path={out}/o", f"input.path={input_path}"]
        cmd = [sys.executable, "-m", "pipeline.cli", "run", config, *(a for item in sets for a in ("--set", item))]
        t0 = time.perf_counter()
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env=env)
        wall = time.perf_counter() - t0
        manifest = Path(out) / "o" / "manifest.json"
        if proc.returncode != 0 or not manifest.is_file():
            # The log tail goes to the console only: it holds this machine's paths.
            print(f"  job run {label} FAILED (exit {proc.returncode}):\n{proc.stderr[-3000:]}", flush=True)
            return {"job_error": f"exit {proc.returncode}", "job_wall_s": round(wall, 1)}
        last = json.loads(manifest.read_text())["last_run"]
    after = last["tokens_per_second_after_engine_start"] or None
    run = {
        "job_tokens": last["tokens"],
        "job_extract_s": last["extract_seconds"],
        "job_wall_s": round(wall, 1),
        "job_first_result_s": last["first_result_seconds"],
        "job_tok_s": round(last["tokens"] / last["extract_seconds"], 1),
        "job_after_start_tok_s": after,
    }
    print(
        f"  job run {label}: {fmt(run['job_tok_s'])} tok/s end to end, after engine start {fmt(after)} tok/s, "
        f"first result after {run['job_first_result_s']} s",
        flush=True,
    )
    return run


def first_layers(model_dir: Path, layers: int, dst: Path) -> Path:
    """A copy of the model with only its first `layers` decoder layers (same weights, embeddings and norm)."""
    import transformers

    # The weights in the dtype they are stored in, so the copy holds the same values.
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype="auto")
    if not 0 < layers < model.config.num_hidden_layers:
        sys.exit(f"--layers must be in 1..{model.config.num_hidden_layers - 1} for this model")
    model.model.layers = model.model.layers[:layers]
    model.config.num_hidden_layers = layers
    model.save_pretrained(dst)
    transformers.AutoTokenizer.from_pretrained(model_dir).save_pretrained(dst)
    return dst


def cut_model(model_dir: Path, layers: int, work: Path) -> tuple[Path, str]:
    """`first_layers` of the model under `work`: the cut model's directory, and how a result names it."""
    name = f"{model_dir.name}, its first {layers} of {num_hidden_layers(model_dir)} layers"
    return first_layers(model_dir, layers, work / "model"), name


def dtype_settings(dtype: str | None) -> tuple[tuple[str, ...], list[str]]:
    """The plain server's flags and the job's settings that make both compute in `dtype` (None: neither set)."""
    return (("--dtype", dtype), [f"engine.server_flags=[--dtype, {dtype}]"]) if dtype else ((), [])


def shipped_set(tok: Tokenize, lines: list[str]) -> list[list[int]]:
    rows = [r for i, line in enumerate(lines) if line.strip() for r in tok.tokenize_line(f"x:{i}", line)]
    return [r["input_ids"] for r in rows if r["status"] == "ok"]


def short_set(tok: Tokenize, lines: list[str], count: int, seed: int) -> list[list[int]]:
    """`count` windows of 48..1024 tokens (log-uniform) cut from the shipped conversations' text; same seed, same set."""
    stream: list[int] = []
    for line in lines:
        try:
            sample = parse_line(line)
        except BadRow:
            continue
        text = sample.text or "\n\n".join(m.get("content") or "" for m in sample.messages)
        stream += tok.tokenizer.tok(text, add_special_tokens=False)["input_ids"] if text else []
    if not stream:
        sys.exit("the config's input has no text to cut the short prompts from")
    while len(stream) <= SHORT_MAX:
        stream += stream
    rng = random.Random(seed)
    out = []
    for _ in range(count):
        # Log-uniform: most prompts short (median ~220 tokens), as in chat data; a few near the top.
        n = int(round(math.exp(rng.uniform(math.log(SHORT_MIN), math.log(SHORT_MAX)))))
        start = rng.randrange(len(stream) - n)
        out.append(stream[start : start + n])
    return out


def median(values):
    values = [v for v in values if v is not None]
    return round(statistics.median(values), 1) if values else None


def summarize(samples: list[list[int]], sweeps: list[dict[int, float]], jobs: list[dict], windows) -> dict:
    plain = {w: median(s[w] for s in sweeps) for w in windows}
    best_w = max(windows, key=lambda w: plain[w])
    job, after = median(j.get("job_tok_s") for j in jobs), median(j.get("job_after_start_tok_s") for j in jobs)
    tokens = sum(map(len, samples))
    job_tokens = {j["job_tokens"] for j in jobs if "job_tokens" in j}
    if job_tokens and job_tokens != {tokens}:
        print(f"  WARNING: the job committed {sorted(job_tokens)} tokens, the plain server got {tokens}", flush=True)
    base = plain[best_w]
    return {
        "samples": len(samples),
        "tokens": tokens,
        "mean_tokens": round(tokens / max(len(samples), 1), 1),
        "median_tokens": sorted(map(len, samples))[len(samples) // 2] if samples else 0,
        "plain": plain,
        "plain_best_window": best_w,
        "plain_best_tok_s": base,
        "job_tok_s": job,
        "job_after_start_tok_s": after,
        "ratio_vs_plain": round(after / base, 3) if after else None,
        "ratio_vs_plain_end_to_end": round(job / base, 3) if job else None,
        # The job's extra time per request over the plain server's, at the set's mean length.
        "ms_per_request_over_plain": round((1 / after - 1 / base) * tokens / len(samples) * 1000, 1) if after else None,
        # Each repeat's job against the plain sweep just before it: the machine's speed drifts between passes
        # (the same plain sweep measured 889 and 754 tok/s minutes apart on a 2-core host), so pairs say more.
        "ratio_vs_plain_per_repeat": [
            round(j["job_after_start_tok_s"] / max(s.values()), 3) if j.get("job_after_start_tok_s") else None
            for s, j in zip(sweeps, jobs)
        ],
        "runs": [{"plain": s, **j} for s, j in zip(sweeps, jobs)],
    }


def job_tokenizer(cfg) -> tuple[Path, Tokenize]:
    """The config's model directory and the job's own tokenize step for it (chat template, loss mask)."""
    model_dir = resolve_model(cfg.model.path)
    tok = Tokenize(
        str(model_dir),
        cfg.extract.max_tokens,
        cfg.extract.overlength,
        cfg.input.id_field,
        cfg.extract.turns,
        dict(cfg.extract.template_kwargs),
    )
    return model_dir, tok


def machine() -> str:
    model = platform.processor()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    mem = psutil.virtual_memory().total / 2**30
    # Whether bf16 matmul is native sets the bf16 forward's speed ~6x, and engine.cpu_dtype: auto follows it.
    bf16 = {True: "native bf16 matmul", False: "no native bf16 matmul", None: "bf16 matmul unknown"}
    return (
        f"{os.cpu_count()} CPU cores, {mem:.0f} GiB, no GPU"
        + (f", {model}" if model else "")
        + (f", {bf16[cpu_has_bf16_matmul()]}")
    )


def command_line() -> str:
    """The command as typed, relative to the repository (no path of this machine)."""
    exe, script = Path(sys.executable), Path(sys.argv[0]).resolve()
    exe = str(exe.relative_to(ROOT)) if exe.is_relative_to(ROOT) else "python"
    script = str(script.relative_to(ROOT)) if script.is_relative_to(ROOT) else sys.argv[0]
    return shlex.join([exe, script, *sys.argv[1:]])


def fmt(v) -> str:
    return f"{v:,.0f}" if v is not None else "n/a"


def ratio(v) -> str:
    return f"{v:.2f}x" if v is not None else "n/a"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--config", default="conf/default.yaml")
    ap.add_argument("--out", default="bench/results/throughput_cpu.json")
    ap.add_argument(
        "--repeats",
        type=int,
        default=1,
        help="plain sweep then job run, R times per set; medians and per-repeat ratios reported",
    )
    ap.add_argument("--limit", type=int, default=0, help="first N prompts of each set only (0: all)")
    ap.add_argument("--short-count", type=int, default=336, help="prompts in the short set")
    ap.add_argument("--seed", type=int, default=0, help="seed of the short set")
    ap.add_argument("--job-set", action="append", default=[], metavar="SECTION.KEY=VALUE", help="passed to the job")
    ap.add_argument(
        "--variant",
        action="append",
        default=[],
        metavar="NAME:SECTION.KEY=VALUE,...",
        help="another job after the default one in every repeat, with these settings as well",
    )
    ap.add_argument("--windows", default="4,8,16,32", help="the plain server's in-flight windows")
    ap.add_argument("--plain-flags", default=shlex.join(USER_FLAGS), help="what a user adds to the plain server")
    ap.add_argument("--dtype", default=None, help="compute dtype of both (plain --dtype, job engine.server_flags)")
    ap.add_argument("--layers", type=int, default=0, help="the model cut to its first N decoder layers (0: whole)")
    only = ap.add_mutually_exclusive_group()
    only.add_argument("--short-only", action="store_true")
    only.add_argument("--shipped-only", action="store_true")
    args = ap.parse_args()
    command = command_line()
    plain_flags = tuple(shlex.split(args.plain_flags))
    windows = tuple(int(w) for w in args.windows.split(","))
    dtype_flags, dtype_sets = dtype_settings(args.dtype)
    plain_flags += dtype_flags
    args.job_set += dtype_sets
    config, out_path = str(Path(args.config).resolve()), Path(args.out).resolve()
    os.chdir(ROOT)  # the config's relative paths (input.path) are relative to the repository

    cfg = load_config(config, args.job_set)
    model_dir, tok = job_tokenizer(cfg)
    lines = Path(cfg.input.path).read_text().splitlines()
    result = {
        "command": command,
        "machine": machine(),
        "date": datetime.date.today().isoformat(),
        "plain_flags": list(plain_flags),
        "job_set": list(args.job_set),
        "sets": {},
    }
    names = ["shipped"] * (not args.short_only) + ["short"] * (not args.shipped_only)
    with tempfile.TemporaryDirectory() as work:
        if args.layers:
            model_dir, result["model"] = cut_model(model_dir, args.layers, Path(work))
            args.job_set.append(f"model.path={model_dir}")  # not in the result: a temporary path
        aux = cfg.extract.aux_layers or default_aux_layers(num_hidden_layers(model_dir))
        threads = cfg.engine.cpu_threads or os.cpu_count()
        for name in names:
            if name == "shipped":
                kept = lines[: args.limit] if args.limit else lines
                samples, rows = shipped_set(tok, kept), kept
            else:
                samples = short_set(tok, lines, args.short_count, args.seed)[: args.limit or None]
                rows = [json.dumps({"id": f"short-{i:04d}", "input_ids": ids}) for i, ids in enumerate(samples)]
            input_path = str(Path(work) / f"{name}.jsonl")
            Path(input_path).write_text("".join(row + "\n" for row in rows))
            print(f"{name}: {len(samples)} samples, {sum(map(len, samples)):,} tokens", flush=True)
            shm = "/dev/shm" if os.path.isdir("/dev/shm") else None
            sweeps, jobs = [], []
            variants = {v.split(":", 1)[0]: v.split(":", 1)[1].split(",") for v in args.variant}
            variant_jobs: dict[str, list[dict]] = {v: [] for v in variants}
            probes = []  # the machine's speed at each phase's edges, per repeat
            for r in range(args.repeats):  # plain, job(s), plain, job(s): all see the machine's drift alike
                probe = {"before_plain": machine_gflops()}
                with tempfile.TemporaryDirectory(dir=shm) as d:
                    spec = ServerSpec(model_dir=model_dir, aux_layers=tuple(aux), dump_dir=Path(d), cpu_threads=threads)
                    sweeps += plain_sweeps(spec, samples, windows, plain_flags, 1)
                probe["after_plain"] = machine_gflops()
                jobs.append(run_job(config, input_path, args.job_set, f"{r + 1}/{args.repeats}"))
                probe["after_job"] = machine_gflops()
                for v, sets in variants.items():
                    variant_jobs[v].append(
                        run_job(config, input_path, args.job_set + sets, f"{v} {r + 1}/{args.repeats}")
                    )
                    probe[f"after_{v}"] = machine_gflops()
                print(f"  machine speed (float32 matmul GFLOP/s) at the phases' edges: {probe}", flush=True)
                probes.append(probe)
            result["sets"][name] = summarize(samples, sweeps, jobs, windows)
            for run, probe in zip(result["sets"][name]["runs"], probes):
                run["machine_gflops"] = probe
            if variants:
                result["sets"][name]["variants"] = {
                    v: {"set": variants[v], **summarize(samples, sweeps, vj, windows)} for v, vj in variant_jobs.items()
                }

    out_path.parent.mkdir(parents=True, exist_ok=True)
    out_path.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")
    for name, s in result["sets"].items():
        print(
            f"{name}: {s['samples']} samples, {s['tokens']:,} tokens | plain best {fmt(s['plain_best_tok_s'])} tok/s "
            f"(window {s['plain_best_window']}; " + ", ".join(f"{w}: {fmt(v)}" for w, v in s["plain"].items()) + ") | "
            f"job after engine start {fmt(s['job_after_start_tok_s'])} tok/s ({ratio(s['ratio_vs_plain'])} plain, "
            f"{s['ms_per_request_over_plain']} ms a request over it) | "
            f"job end to end {fmt(s['job_tok_s'])} tok/s ({ratio(s['ratio_vs_plain_end_to_end'])} plain)"
        )
        for v, vs in s.get("variants", {}).items():
            print(
                f"  variant {v} ({', '.join(vs['set'])}): job after engine start {fmt(vs['job_after_start_tok_s'])} "
                f"tok/s ({ratio(vs['ratio_vs_plain'])} plain; per repeat {vs['ratio_vs_plain_per_repeat']})"
            )


if __name__ == "__main__":
    main()

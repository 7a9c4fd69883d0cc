"""Which server flags make a bare SGLang server fast or slow on short prompts (CPU), in one run: the same
prompts sent to one server per variant, each at 4/8/16 in flight after a warm-up.

  python bench/probes/bench_server_flags.py [--prompts 120] [--variants plain,plain-kv,project,capture] [--windows 4,8,16]
                                     [--passes 1] [--throughput-set] [--out bench/results/server_flags_cpu.json]

Prompts: log-uniform in 48-1,024 tokens (median ~220), windows of the shipped conversations' token stream.
Variants (each a real `sglang.launch_server`; the CPU stand-in and env as actors/sglang/server.py gives them):
  plain:     SGLang's defaults plus what CPU mode needs (--device cpu --attention-backend torch_native
             --disable-cuda-graph) and --disable-radix-cache (a repeated prompt would return only its suffix)
  plain-kv:  plain plus the project's KV sizing (--mem-fraction-static, --max-total-tokens)
  project:   the project's bare spec (ServerSpec(capture=False), bench/bench_throughput.py's baseline until 2026-12)
  capture:   the job's server (aux capture, the hook; dumps are written and left unread)
  stock:     bench/bench_throughput.py's plain baseline exactly (bench/plain_sglang.py's plain_server with
             USER_FLAGS): plain's flags plus --mem-fraction-static 0.2, none of the project's environment
A variant may be named more than once (plain,capture,plain,capture): each is a fresh server, in that order, and
`servers` lists every one with all its passes. --passes N sweeps the windows N times on the same server: on a
2-core host one server's passes over the same prompts spread by 10 % and more, which a single pass hides.
--throughput-set uses bench/bench_throughput.py's short set (the job benchmark's prompts) instead.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import math
import platform
import random
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from plain_sglang import USER_FLAGS, plain_server, send_all  # noqa: E402

import actors.sglang.server as server_mod  # noqa: E402
from actors.sglang.server import CPU_KV_TOKENS, CPU_MEM_FRACTION, ServerSpec, SGLangServer  # noqa: E402
from pipeline.driver.plan import default_aux_layers  # noqa: E402
from pipeline.intake.model import num_hidden_layers, prepare_default_model  # noqa: E402


def prompts(model, n: int, seed: int = 0) -> list[list[int]]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model)
    stream: list[int] = []
    for line in (ROOT / "conf" / "data" / "sample_conversations.jsonl").read_text().splitlines():
        for m in json.loads(line).get("messages", []):
            stream += tok(m.get("content") or "", add_special_tokens=False)["input_ids"]
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        length = int(math.exp(rng.uniform(math.log(48), math.log(1024))))
        start = rng.randrange(len(stream) - length)
        out.append(stream[start : start + length])
    return out


def throughput_set(n: int) -> list[list[int]]:
    """bench_throughput.py's short set (its defaults: the default config's input, seed 0), first `n` prompts."""
    from bench.bench_throughput import job_tokenizer, short_set
    from conf.schema import load_config

    cfg = load_config(str(ROOT / "conf" / "default.yaml"), [])
    _, tok = job_tokenizer(cfg)
    lines = (ROOT / cfg.input.path).read_text().splitlines()  # relative to the repository, as the bench's
    return short_set(tok, lines, n, 0)


def command_for(variant: str, model: Path):
    project = server_mod.build_command

    def build(spec, port):
        if not variant.startswith("plain"):
            return project(spec, port)
        cmd = [sys.executable, "-m", "sglang.launch_server", "--model-path", str(model), "--host", "127.0.0.1"]
        cmd += ["--port", str(port), "--device", "cpu", "--attention-backend", "torch_native"]
        cmd += ["--disable-cuda-graph", "--disable-radix-cache"]
        if variant == "plain-kv":
            cmd += ["--mem-fraction-static", CPU_MEM_FRACTION, "--max-total-tokens", str(CPU_KV_TOKENS)]
        return cmd

    return build


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompts", type=int, default=120)
    ap.add_argument("--variants", default="plain,plain-kv,project,capture")
    ap.add_argument("--windows", default="4,8,16", help="requests in flight, each swept")
    ap.add_argument("--passes", type=int, default=1, help="sweeps of the windows on each server")
    ap.add_argument("--throughput-set", action="store_true", help="bench_throughput.py's short set as the prompts")
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "server_flags_cpu.json")
    args = ap.parse_args()
    model = prepare_default_model()
    samples = throughput_set(args.prompts) if args.throughput_set else prompts(model, args.prompts)
    tokens = sum(map(len, samples))
    lengths = sorted(map(len, samples))
    result = {
        "benchmark": "bare SGLang server on short prompts, one server per flag variant, the same prompts",
        "machine": f"{platform.machine()}, {platform.processor() or 'cpu'}",
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d"),
        "command": "python bench/probes/bench_server_flags.py " + " ".join(sys.argv[1:]),
        "prompts": {"count": len(samples), "tokens": tokens, "median": lengths[len(lengths) // 2]},
        "variants": {},
        "servers": [],
    }
    aux = default_aux_layers(num_hidden_layers(model))
    project_build = server_mod.build_command
    for variant in args.variants.split(","):
        server_mod.build_command = command_for(variant, model)
        try:
            with tempfile.TemporaryDirectory() as d:
                spec = ServerSpec(
                    model_dir=model, aux_layers=tuple(aux), dump_dir=Path(d), capture=variant == "capture"
                )
                t0 = time.monotonic()
                with plain_server(spec, USER_FLAGS) if variant == "stock" else SGLangServer(spec) as server:
                    entry = {
                        "startup_s": round(time.monotonic() - t0, 1),
                        "flags": server_mod.build_command(server.spec, 0)[3:],
                    }
                    asyncio.run(send_all(server.url, samples[:4], 4))  # warm-up
                    passes = []
                    for _ in range(args.passes):
                        for window in [int(w) for w in args.windows.split(",")]:
                            rate = round(tokens / asyncio.run(send_all(server.url, samples, window)), 1)
                            passes.append({"window": window, "tok_s": rate})
                            entry[f"tok_s_at_{window}"] = rate  # the last pass at this window
                            print(variant, window, rate, flush=True)
        finally:
            server_mod.build_command = project_build
        entry["flags"] = [f for f in entry["flags"] if not f.startswith("/")]
        result["variants"][variant] = entry
        result["servers"].append({"variant": variant, "startup_s": entry["startup_s"], "passes": passes})
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()

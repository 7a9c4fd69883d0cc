"""Who takes the CPU while the job extracts on a small machine: the SGLang server, the driver, Ray's daemons, the actor.

  python bench/probes/bench_cpu_share.py [--prompts 150] [--idle-s 30] [--skip-idle | --idle-only] [--layers N]
                                  [--dtype float32] [--idle-variant NAME:K=V,...] [--idle-repeats 1]
                                  [--out bench/results/cpu_share_cpu.json]

1. An idle local Ray (`ray.init`, no work), with and without its dashboard: each of its processes' CPU over
   --idle-s seconds, as a share of one core. Each --idle-variant runs the dashboard's idle phase again under
   Ray settings given as environment variables (RAY_<name>, read by every Ray process at its start), e.g. its
   internal report periods: whether Ray's fixed share of a small machine can be tuned away. With
   --idle-repeats N the phases take turns N times, since an idle share moves by ~1 % of a core between runs.
2. The default job (`harvest run conf/default.yaml`, SGLang in CPU mode) on the short prompt set of
   bench/bench_throughput.py: every process of this user sampled from /proc every 0.5 s, and each role's CPU
   from the moment the engine was up to the last result (the manifest's clock), as a share of one core. On a
   2-core machine the server's two OpenMP threads want both cores; whatever else runs takes from them.
3. A plain `sglang.launch_server` (bench/plain_sglang.py) on the same prompts at 16 in flight (the job's default
   window), sampled the same way: what the server takes of the cores when nothing else runs. For the server,
   both phases also give its system time and its processes' niceness.
--layers N and --dtype D as in bench/bench_throughput.py (the model cut to its first N layers: the server of a
CPU with native bf16 matmul, on one without; both sides computing in D).
The sampler itself costs ~4-6 % of one core (reading /proc for every process twice a second); it is not counted
among the roles but takes from the server like them, in both phases alike.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from bench_throughput import (  # noqa: E402
    command_line,
    cut_model,
    dtype_settings,
    job_tokenizer,
    machine,
    short_set,
)
from plain_sglang import USER_FLAGS, plain_server, sweep  # noqa: E402

from actors.sglang.server import ServerSpec  # noqa: E402
from conf.schema import load_config  # noqa: E402


def role(p: psutil.Process) -> str:
    name, cmd = p.name(), " ".join(p.cmdline())
    # The server's own children (scheduler, detokenizer) are multiprocessing processes named "python".
    if any("sglang" in " ".join(q.cmdline()) for q in (p, *p.parents())):
        return "sglang server"
    if "pipeline.cli" in cmd:
        return "driver"
    if cmd.startswith("ray::"):  # Ray's workers carry their task or actor in their process title (argv)
        if "HiddenStateExtractor" in cmd:
            return "actor"
        title = cmd.split()[0]
        if "Agent" in title:
            return "ray agents"
        # By title (ray::IDLE, a Ray Data map worker, the tokenizer's actors): which of Ray's workers take the CPU.
        return f"ray worker {title.removeprefix('ray::').split('(')[0]}"
    if name in ("gcs_server", "raylet"):
        return f"ray {name.replace('_server', '')}"
    if "dashboard" in cmd:
        return "ray agents" if "agent" in cmd else "ray dashboard"
    if "log_monitor" in cmd:
        return "ray log monitor"
    return "other"


class Sampler:
    """Each of this user's processes' CPU seconds, every `every` s, with their role (this process left out)."""

    def __init__(self, every: float = 0.5):
        self.every, self.rows, self._stop = every, [], threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        me, roles = os.getpid(), {}
        while not self._stop.is_set():
            snap = {}
            for p in psutil.process_iter():
                try:
                    if p.pid == me or p.uids().real != os.getuid():
                        continue
                    # A worker starts under the interpreter's name and takes its task's title later: looked
                    # at again until it has a role of its own.
                    if roles.get(p.pid, "other") == "other" or roles[p.pid].startswith("ray worker"):
                        roles[p.pid] = role(p)
                    t = p.cpu_times()
                    snap[p.pid] = (roles[p.pid], t.user + t.system, t.system, p.nice())
                except (psutil.Error, OSError):
                    continue
            self.rows.append((time.time(), snap))
            self._stop.wait(self.every)

    def __enter__(self) -> Sampler:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    def _span(self, start: float, end: float):
        """The first and last samples within [start, end] as (t0, first, t1, last), or None with fewer than two."""
        inside = [r for r in self.rows if start <= r[0] <= end]
        return (*inside[0], *inside[-1]) if len(inside) >= 2 else None

    def shares(self, start: float, end: float) -> dict[str, float]:
        """Per role: CPU seconds between the samples nearest `start` and `end`, as % of one core."""
        span = self._span(start, end)
        if span is None:
            return {}
        t0, a, t1, b = span
        out: dict[str, float] = {}
        for pid, (name, cpu, *_) in b.items():
            out[name] = out.get(name, 0.0) + cpu - (a[pid][1] if pid in a else 0.0)
        return {k: round(100 * v / (t1 - t0), 1) for k, v in sorted(out.items(), key=lambda kv: -kv[1]) if v > 0}

    def server(self, start: float, end: float) -> dict:
        """The SGLang server's system time (% of one core) between `start` and `end`, and its processes'
        niceness (the server inherits its starter's: Ray starts its workers at 15, its daemons and the
        driver stay at 0)."""
        span = self._span(start, end)
        if span is None:
            return {}
        t0, a, t1, b = span
        mine = {pid: row for pid, row in b.items() if row[0] == "sglang server"}
        system = sum(row[2] - (a[pid][2] if pid in a else 0.0) for pid, row in mine.items())
        others = {row[3] for row in b.values() if row[0] in ("driver", "ray gcs", "ray raylet", "ray dashboard")}
        return {
            "system_share_of_one_core": round(100 * system / (t1 - t0), 1),
            "niceness": sorted({row[3] for row in mine.values()}),
            "niceness_of_driver_and_ray_daemons": sorted(others),
        }


def idle_ray(seconds: float, dashboard: bool, ray_env: dict[str, str] | None = None) -> dict[str, float]:
    code = (
        "import ray, time, sys; ray.init(num_cpus=2, include_dashboard=sys.argv[1] == '1'); "
        "print('up', flush=True); time.sleep(float(sys.argv[2]))"
    )
    env = dict(os.environ, RAY_USAGE_STATS_ENABLED="0", RAY_ADDRESS="", **(ray_env or {}))
    with Sampler() as s:
        proc = subprocess.Popen(
            [sys.executable, "-c", code, "1" if dashboard else "0", str(seconds + 20)],
            env=env,
            stdout=subprocess.PIPE,
            text=True,
        )
        proc.stdout.readline()  # Ray is up
        time.sleep(10)  # its start-up settles
        t0 = time.time()
        time.sleep(seconds)
        shares = s.shares(t0, time.time())
        proc.wait()
    shares.pop("other", None)  # the idle driver's own process
    return shares | {"total": round(sum(shares.values()), 1)}


def short_prompts(prompts: int) -> tuple[Path, list[list[int]]]:
    cfg = load_config(str(ROOT / "conf" / "default.yaml"), [])
    model_dir, tok = job_tokenizer(cfg)
    lines = (ROOT / cfg.input.path).read_text().splitlines()
    return model_dir, short_set(tok, lines, prompts, 0)


def plain(model_dir: Path, samples: list[list[int]], flags: tuple[str, ...], window: int = 16) -> dict:
    """The plain server alone, sampled over one pass of the prompts at `window` in flight."""
    with tempfile.TemporaryDirectory() as logs:  # the server's log goes there
        spec = ServerSpec(model_dir=model_dir, aux_layers=(), dump_dir=Path(logs), cpu_threads=os.cpu_count())
        with Sampler() as s, plain_server(spec, USER_FLAGS + flags) as server:
            t0 = time.time()  # sweep() warms the server with 4 prompts first: ~1 s of this window
            rate = sweep(server.url, samples, [window])[window]
            t1 = time.time()
    return {
        "window": window,
        "window_s": round(t1 - t0, 1),
        "tok_s": rate,
        "cpu_share_of_one_core": s.shares(t0, t1),
        "server": s.server(t0, t1),
    }


def job(samples: list[list[int]], sets: list[str]) -> dict:
    prompts = len(samples)
    with tempfile.TemporaryDirectory() as work:
        rows = Path(work) / "short.jsonl"
        rows.write_text("".join(json.dumps({"id": f"s{i}", "input_ids": s}) + "\n" for i, s in enumerate(samples)))
        cmd = [sys.executable, "-m", "pipeline.cli", "run", "conf/default.yaml"]
        cmd += [a for item in [*sets, f"input.path={rows}", f"output.path={work}/o"] for a in ("--set", item)]
        env = dict(os.environ, RAY_ADDRESS="")
        with Sampler() as s:
            proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
        if proc.returncode != 0:
            sys.exit(f"the job failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
        last = json.loads((Path(work) / "o" / "manifest.json").read_text())["last_run"]
    shares = s.shares(last["engines_ready_unix"], last["last_result_unix"])
    server = s.server(last["engines_ready_unix"], last["last_result_unix"])
    return {
        "prompts": prompts,
        "tokens": sum(map(len, samples)),
        "window_s": round(last["last_result_unix"] - last["engines_ready_unix"], 1),
        "tok_s_after_engine_start": last["tokens_per_second_after_engine_start"],
        "cpu_share_of_one_core": shares,
        "server": server,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--prompts", type=int, default=150)
    ap.add_argument("--idle-s", type=float, default=30.0)
    ap.add_argument("--skip-idle", action="store_true", help="leave out the idle-Ray phase")
    ap.add_argument("--idle-only", action="store_true", help="only the idle-Ray phase")
    ap.add_argument("--idle-variant", action="append", default=[], type=idle_variant, help="NAME:RAY_X=V,RAY_Y=W")
    ap.add_argument("--idle-repeats", type=int, default=1)
    ap.add_argument("--layers", type=int, default=0, help="the model cut to its first N decoder layers (0: whole)")
    ap.add_argument("--dtype", default=None, help="compute dtype of both (plain --dtype, job engine.server_flags)")
    ap.add_argument("--out", default="bench/results/cpu_share_cpu.json")
    args = ap.parse_args()
    if args.idle_repeats < 1:
        ap.error("--idle-repeats: at least 1")
    if args.skip_idle and args.idle_only:
        ap.error("--skip-idle and --idle-only leave nothing to measure")
    command = command_line()  # before the chdir: it resolves the script's path as typed
    os.chdir(ROOT)
    result = {
        "benchmark": "CPU share by process role: an idle local Ray, the default job and a plain server on short prompts",
        "command": command,
        "machine": machine(),
        "date": datetime.date.today().isoformat(),
    }
    if not args.skip_idle:
        phases = {"with_dashboard": (True, {}), "without_dashboard": (False, {})}
        phases |= {name: (True, env) for name, env in args.idle_variant}
        runs = {name: [] for name in phases}
        for _ in range(args.idle_repeats):
            for name, (dashboard, env) in phases.items():
                runs[name].append(idle_ray(args.idle_s, dashboard, env))
        result["idle_ray"] = {name: r[0] if len(r) == 1 else r for name, r in runs.items()}
        result["idle_ray_env"] = {name: env for name, env in args.idle_variant}
    if args.idle_only:
        finish(result, args.out)
        return
    model_dir, samples = short_prompts(args.prompts)
    flags, sets = dtype_settings(args.dtype)
    with tempfile.TemporaryDirectory() as work:
        if args.layers:
            model_dir, result["model"] = cut_model(model_dir, args.layers, Path(work))
            sets.append(f"model.path={model_dir}")
        result["job"] = job(samples, sets)
        result["plain_server"] = plain(model_dir, samples, flags)
    finish(result, args.out)


def idle_variant(text: str) -> tuple[str, dict[str, str]]:
    """'NAME:RAY_X=V,RAY_Y=W' -> (NAME, {RAY_X: V, ...}); only Ray's own settings (RAY_ prefix)."""
    name, sep, pairs = text.partition(":")
    parts = pairs.split(",") if pairs else []
    env = dict(kv.split("=", 1) for kv in parts if "=" in kv)
    taken = name in ("with_dashboard", "without_dashboard")  # the default phases' names
    if (
        not sep
        or not name
        or taken
        or not parts
        or len(env) != len(parts)
        or any(not k.startswith("RAY_") for k in env)
    ):
        raise argparse.ArgumentTypeError(f"{text!r}: expected NAME:RAY_X=V[,RAY_Y=W...]")
    return name, env


def finish(result: dict, out: str) -> None:
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    Path(out).write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()

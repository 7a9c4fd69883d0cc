"""One SGLang server subprocess with the hidden-state dump hook: start, health, requests, close.

The server runs on 127.0.0.1 as `python -m sglang.launch_server`. The hook (patches/sglang/) reaches
the scheduler process through PYTHONPATH, and writes each request's hidden states into `dump_dir`
as `<rid>.hhd`. Flags that would silently truncate hidden states are set here and cannot be
overridden by the user: the radix cache (a repeated prompt would return only its uncached suffix). The
prefill chunk size is a setting of its own (engine.chunked_prefill_size): the hook assembles chunks by
request id, so it is never passed through server_flags either.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import requests

from actors.cpu import cpu_has_bf16_matmul
from actors.engine import EngineDied
from patches.sglang import server_pythonpath
from pipeline import envs

logger = logging.getLogger(__name__)

RID_PREFIX = "hh-"
# CPU mode: SGLang sizes the KV pool as (free memory after loading) - (1 - fraction) x (free memory before
# loading), and refuses to start when that is not positive, i.e. when loading took more than `fraction` of
# what was free. On a CPU host the loading is not alone: a second actor's server, the test's or notebook's
# own models, Ray's object store allocate meanwhile. A fixed 0.2 failed a start whenever they took ~20 % of
# free memory (a suite run did). A generous fraction tolerates them; the pool itself is capped in tokens
# (--max-total-tokens), so the generous fraction does not turn into a pool of half the machine.
CPU_MEM_FRACTION = "0.6"
CPU_KV_TOKENS = 131072  # 16 requests of 8192 tokens; ~3 GB for the default model (23 KB/token)


def cpu_kv_tokens(max_in_flight: int, max_prompt_tokens: int) -> int:
    """The KV pool of a capturing CPU server, in tokens: every request of the window at the longest prompt
    the job sends (one new token each), within CPU_KV_TOKENS, and never below one such prompt.

    SGLang zeroes the whole pool at start. On a 2-core CPU a pool of CPU_KV_TOKENS cost ~8 s of kernel time
    faulting 3 GB in (the server ready in 27.0 s, its scheduler at 4.3 GB); sized to the default job (16
    prompts of up to 2,048 tokens) it was ready in 24.3-25.3 s at 2.2 GB. A smaller pool never loses a
    sample: the scheduler only admits fewer requests at once."""
    return max(min(max_in_flight * (max_prompt_tokens + 1), CPU_KV_TOKENS), max_prompt_tokens + 1)


# Flags the engine owns; a user flag naming one of them is refused.
_OWNED_FLAGS = (
    "--model-path",
    "--host",
    "--port",
    "--tp-size",
    "--device",
    "--disable-radix-cache",
    "--chunked-prefill-size",
    "--enable-return-aux-hidden-states",
    "--speculative-algorithm",
    "--return-aux-hidden-state-layer-ids",
    "--enable-mixed-chunk",
    # A prefill CUDA graph would replay the forward without the hook's host-side code (no dumps).
    "--disable-prefill-cuda-graph",
    "--cuda-graph-backend-prefill",
    "--cuda-graph-config",
    # SGLang's aliases for owned flags.
    "--model",
    "--tensor-parallel-size",
)


@dataclass(frozen=True)
class ServerSpec:
    model_dir: Path
    # Decoder layer outputs to capture (HF hidden_states[i+1]); () leaves SGLang's own EAGLE-3 default.
    aux_layers: tuple[int, ...]
    dump_dir: Path
    tp_size: int = 1
    # Prefill chunk size in tokens (-1: never chunk). The hook assembles a request's chunks by request id.
    chunked_prefill_size: int = 8192
    cpu: bool = True
    cpu_threads: int | None = None
    # False: a plain server without aux capture or hook (the benchmark's baseline), never used by the job.
    capture: bool = True
    # SGLang's prefix (radix) cache. Off wherever every position must be computed: a capture, and the
    # benchmarks' plain baselines, which run the same prompts more than once. On for generation only
    # (regeneration), where turn k+1 of a conversation and a shared system prompt reuse it.
    prefix_cache: bool = False
    extra_flags: tuple[str, ...] = ()
    startup_timeout_s: float = 300.0
    # The final layer dumped: the final norm's output (post_norm), or its input (pre_norm; the job's default).
    final_layer: str = "post_norm"
    # The dump body: bf16 byte planes, or fp8 quantized inside the server (an fp8 output; actors/dump.py).
    capture_layout: str = "planes"
    # A CPU server's KV pool in tokens (cpu_kv_tokens); None: CPU_KV_TOKENS. A user's memory flag replaces it.
    kv_tokens: int | None = None
    env: dict[str, str] = field(default_factory=dict)

    def __post_init__(self):
        if self.capture and self.prefix_cache:
            raise ValueError("a capturing server computes every position: prefix_cache must stay off")
        if self.final_layer not in ("post_norm", "pre_norm"):
            raise ValueError(f"final_layer {self.final_layer!r}: post_norm or pre_norm")
        if self.capture_layout not in ("planes", "fp8"):
            raise ValueError(f"capture_layout {self.capture_layout!r}: planes or fp8")
        for flag in self.extra_flags:
            name = flag.split("=", 1)[0]
            # argparse also accepts unique prefixes (--chunked-prefill means --chunked-prefill-size).
            if name.startswith("--") and any(owned.startswith(name) for owned in _OWNED_FLAGS):
                raise ValueError(
                    f"engine.server_flags may not set {name}: hidden-harvest sets it so hidden states are "
                    "complete and captured (see actors/sglang/server.py)"
                )


def cpu_dtype_flags(setting: str, user_flags: tuple[str, ...], cpuinfo: str | None = None) -> tuple[str, ...]:
    """The --dtype the server computes in on the CPU (engine.cpu_dtype): a user's own --dtype always stands;
    `auto` adds float32 where bf16 matmul is not native (and so slow), `model` leaves SGLang's own choice."""
    if any(f == "--dtype" or f.startswith("--dtype=") for f in user_flags):
        return ()
    if setting == "float32" or (setting == "auto" and cpu_has_bf16_matmul(cpuinfo) is False):
        return ("--dtype", "float32")
    return ()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def build_command(spec: ServerSpec, port: int) -> list[str]:
    # User flags first: argparse keeps the last value, so the engine's own flags always win.
    cmd = [sys.executable, "-m", "sglang.launch_server", *spec.extra_flags]
    cmd += [
        "--model-path",
        str(spec.model_dir),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--tp-size",
        str(spec.tp_size),
        "--chunked-prefill-size",
        str(spec.chunked_prefill_size),
    ]
    if not spec.prefix_cache:
        cmd.append("--disable-radix-cache")
    if spec.capture:
        cmd += [
            "--enable-return-aux-hidden-states",
            "--speculative-algorithm",
            "EAGLE3",
        ]
        # No ids: SGLang's own EAGLE-3 default layers; the test that pins our default against it uses that.
        if spec.aux_layers:
            cmd += ["--return-aux-hidden-state-layer-ids", *[str(i) for i in spec.aux_layers]]
    if not spec.cpu:
        cmd += ["--disable-prefill-cuda-graph"]  # SGLang 0.5.23 captures prefill graphs on CUDA by default
    # SGLang's scheduler polls its sockets without pause when it has nothing to run: a whole core per
    # idle server, taken from the actor's validation and encoding between
    # batches, from a second actor's server, from everything else on a small machine. With this flag it
    # blocks on the same sockets while idle and wakes as a request arrives.
    cmd += ["--sleep-on-idle"]
    if spec.cpu:
        cmd += ["--device", "cpu", "--attention-backend", "torch_native", "--disable-cuda-graph"]
        user = {f.split("=")[0] for f in spec.extra_flags}
        if "--mem-fraction-static" not in user:
            cmd += ["--mem-fraction-static", CPU_MEM_FRACTION]
            if "--max-total-tokens" not in user:
                cmd += ["--max-total-tokens", str(spec.kv_tokens or CPU_KV_TOKENS)]
    return cmd


# glibc malloc for a CPU server. By default it serves large blocks with mmap and raises that threshold only as
# blocks are freed, and it hands freed heap back to the kernel: every forward of a new size faults fresh
# pages in, so a fresh server's first pass over new prompts runs slow. A fixed threshold, no trim and heap
# grown in 256 MiB steps remove most of that (bench/results/server_warmth_malloc_cpu.json). The trim threshold
# alone is harmful (it fixes the mmap threshold at its default), so the three go together, and only where the
# user set none of glibc's own.
CPU_MALLOC_ENV = {
    "MALLOC_MMAP_THRESHOLD_": str(32 * 2**20),
    "MALLOC_TRIM_THRESHOLD_": str(16 * 2**30),
    "MALLOC_TOP_PAD_": str(256 * 2**20),
}


def build_env(spec: ServerSpec) -> dict[str, str]:
    env = dict(os.environ)
    env.update(spec.env)
    extra = [str(p) for p in server_pythonpath(cpu=spec.cpu)]
    env["PYTHONPATH"] = os.pathsep.join(extra + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    env.pop(envs.DUMP_DIR.name, None)
    # The server's own watchdog (patches/) ends it when this process dies, whichever thread started it:
    # a Ray actor killed by force never runs its teardown.
    env[envs.PARENT_PID.name] = str(os.getpid())
    # Nothing of the server listens beyond 127.0.0.1: torch's rendezvous store would bind every interface.
    env[envs.LOOPBACK.name] = "1"
    if spec.cpu and not any(k.startswith("MALLOC_") for k in env):
        env.update(CPU_MALLOC_ENV)
    if not spec.cpu:
        # One server is one node: the collective libraries' bootstrap sockets need no other interface.
        env.setdefault("NCCL_SOCKET_IFNAME", "lo")
        env.setdefault("GLOO_SOCKET_IFNAME", "lo")
    if spec.capture:
        env[envs.DUMP_DIR.name] = str(spec.dump_dir)
        env[envs.RID_PREFIX.name] = RID_PREFIX
        env[envs.FINAL.name] = spec.final_layer
        env[envs.LAYOUT.name] = spec.capture_layout
        env[envs.AUX_LAYERS.name] = ",".join(str(i) for i in spec.aux_layers)
    if spec.cpu:
        env["SGLANG_USE_CPU_ENGINE"] = "1"
        threads = str(spec.cpu_threads or os.cpu_count() or 1)
        env["OMP_NUM_THREADS"] = env["MKL_NUM_THREADS"] = threads
    return env


class SGLangServer:
    """Explicit lifecycle: start() ... close(); also a context manager. Never relies on __del__."""

    def __init__(self, spec: ServerSpec):
        self.spec = spec
        self.port: int | None = None
        self._proc: subprocess.Popen | None = None
        self._log_path = spec.dump_dir / "server.log"
        self.phases: dict[str, float] = {}  # the last start's seconds: load_s, warm_up_s (_wait_ready)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> SGLangServer:
        self.spec.dump_dir.mkdir(parents=True, exist_ok=True)
        self.port = free_port()
        cmd = build_command(self.spec, self.port)
        logger.info("starting SGLang server: %s", " ".join(cmd))
        log = open(self._log_path, "ab")
        try:
            self._proc = subprocess.Popen(
                cmd,
                env=build_env(self.spec),
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        finally:
            log.close()
        self._wait_ready()
        return self

    def _wait_ready(self) -> None:
        """Until /health passes. On the way, when the HTTP server first answers: SGLang starts it once the
        scheduler has loaded the model, so that splits the start into loading and the first generation
        (`phases`: load_s, warm_up_s)."""
        t0 = time.monotonic()
        deadline = t0 + self.spec.startup_timeout_s
        loaded = None
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                raise EngineDied(f"SGLang server exited with {self._proc.returncode} during start:\n{self.log_tail()}")
            if loaded is None and self.alive(timeout=2.0):
                loaded = time.monotonic()
            if loaded is not None and self.healthy(timeout=2.0):
                now = time.monotonic()
                self.phases = {"load_s": round(loaded - t0, 3), "warm_up_s": round(now - loaded, 3)}
                logger.info("SGLang server ready on %s (pid %d): %s", self.url, self._proc.pid, self.phases)
                return
            time.sleep(0.5 if loaded is None else 0.2)
        self.close()
        raise EngineDied(f"SGLang server not ready after {self.spec.startup_timeout_s:.0f}s:\n{self.log_tail()}")

    def healthy(self, timeout: float = 5.0) -> bool:
        """Ready to serve: SGLang's /health runs a one-token generation through the scheduler (start-up)."""
        return self._get("/health", timeout)

    def alive(self, timeout: float = 10.0) -> bool:
        """The process runs and its HTTP server answers. Not /health: that queues a generation behind the
        work in flight, which on a busy server takes longer than any sensible timeout, and a busy server
        must never be taken for a dead one and restarted."""
        return self._get("/model_info", timeout)

    def _get(self, path: str, timeout: float) -> bool:
        if self._proc is None or self._proc.poll() is not None:
            return False
        try:
            return requests.get(f"{self.url}{path}", timeout=timeout).status_code == 200
        except requests.RequestException:
            return False

    def log_tail(self, n: int = 40) -> str:
        try:
            return "\n".join(self._log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return "(no server log)"

    def close(self) -> None:
        proc, self._proc = self._proc, None
        if proc is None:
            return
        if proc.poll() is not None:
            # The launcher is gone (it exited during start, or was killed): its scheduler children may not be.
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
            return
        # The server spawns scheduler/detokenizer children: signal the whole process group.
        for sig, wait_s in ((signal.SIGTERM, 30.0), (signal.SIGKILL, 10.0)):
            try:
                os.killpg(proc.pid, sig)
            except ProcessLookupError:
                return
            try:
                proc.wait(timeout=wait_s)
                return
            except subprocess.TimeoutExpired:
                logger.warning("SGLang server pid %d ignored %s", proc.pid, sig.name)

    def __enter__(self) -> SGLangServer:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()

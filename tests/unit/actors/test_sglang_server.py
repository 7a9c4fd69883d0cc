import os
from pathlib import Path

import pytest

from actors.sglang.server import (
    CPU_KV_TOKENS,
    CPU_MALLOC_ENV,
    CPU_MEM_FRACTION,
    RID_PREFIX,
    ServerSpec,
    build_command,
    build_env,
)

PATCH_ROOT = Path(__file__).resolve().parents[3] / "patches" / "sglang" / "v0_5_23"


def spec(**kw) -> ServerSpec:
    kw.setdefault("aux_layers", (2, 15, 27))
    return ServerSpec(model_dir=Path("/models/m"), dump_dir=Path("/dev/shm/d"), **kw)


def value_after(cmd: list[str], flag: str, n: int = 1) -> list[str]:
    i = cmd.index(flag)
    return cmd[i + 1 : i + 1 + n]


@pytest.mark.parametrize(
    "flag",
    [
        "--disable-radix-cache",
        "--chunked-prefill-size=512",
        "--port=30000",
        "--tp-size",
        "--return-aux-hidden-state-layer-ids",
        "--enable-mixed-chunk",
    ],
)
def test_engine_owned_flags_are_refused(flag):
    with pytest.raises(ValueError, match=f"may not set {flag.split('=')[0]}"):
        spec(extra_flags=(flag,))


@pytest.mark.parametrize("flags", [("--chunked-prefill", "512"), ("--tensor-parallel-size", "2"), ("--model", "/x")])
def test_aliases_and_prefixes_of_owned_flags_are_refused(flags):
    with pytest.raises(ValueError):
        spec(extra_flags=flags)


def test_user_flags_come_before_the_engines_own_so_the_engine_wins():
    cmd = build_command(spec(extra_flags=("--log-level", "debug", "--max-running-requests=4")), 1234)
    assert cmd[3:6] == ["--log-level", "debug", "--max-running-requests=4"]
    assert cmd.index("--disable-radix-cache") > 5


@pytest.mark.parametrize("cpu", [True, False])
def test_command_always_disables_truncating_features(cpu):
    cmd = build_command(spec(cpu=cpu, tp_size=1 if cpu else 2), 4321)
    assert cmd[1:3] == ["-m", "sglang.launch_server"]
    assert "--disable-radix-cache" in cmd
    assert value_after(cmd, "--chunked-prefill-size") == ["8192"]  # the hook assembles chunks
    assert value_after(cmd, "--return-aux-hidden-state-layer-ids", 3) == ["2", "15", "27"]
    assert "--enable-return-aux-hidden-states" in cmd
    assert value_after(cmd, "--model-path") == ["/models/m"]
    assert value_after(cmd, "--port") == ["4321"]
    assert value_after(cmd, "--host") == ["127.0.0.1"]
    assert value_after(cmd, "--tp-size") == ["1" if cpu else "2"]


def test_no_layer_ids_leaves_sglangs_own_eagle3_default():
    cmd = build_command(spec(aux_layers=()), 1)
    assert "--enable-return-aux-hidden-states" in cmd and value_after(cmd, "--speculative-algorithm") == ["EAGLE3"]
    assert "--return-aux-hidden-state-layer-ids" not in cmd


def test_chunked_prefill_size_is_the_engines_setting():
    assert value_after(build_command(spec(chunked_prefill_size=-1), 1), "--chunked-prefill-size") == ["-1"]
    with pytest.raises(ValueError, match="may not set"):
        spec(extra_flags=("--chunked-prefill-size", "128"))


def test_prefill_cuda_graphs_are_off_on_gpus_and_cannot_be_turned_on():
    """A prefill CUDA graph would replay the forward without the hook (no dumps)."""
    assert "--disable-prefill-cuda-graph" in build_command(spec(cpu=False), 1)
    for flag in ("--cuda-graph-backend-prefill=breakable", "--cuda-graph-config={}", "--disable-prefill-cuda-graph"):
        with pytest.raises(ValueError, match="may not set"):
            spec(cpu=False, extra_flags=(flag,))


def test_cpu_flags_only_in_cpu_mode():
    cpu = build_command(spec(cpu=True), 1)
    assert value_after(cpu, "--device") == ["cpu"]
    assert value_after(cpu, "--attention-backend") == ["torch_native"]
    assert "--disable-cuda-graph" in cpu
    gpu = build_command(spec(cpu=False), 1)
    for flag in ("--device", "--attention-backend", "--disable-cuda-graph", "--mem-fraction-static"):
        assert flag not in gpu


def test_cpu_kv_pool_tolerates_other_allocations_and_is_capped_in_tokens():
    cmd = build_command(spec(cpu=True), 1)
    # A fraction well above what two servers starting side by side take from each other meanwhile...
    assert float(value_after(cmd, "--mem-fraction-static")[0]) >= 0.5
    # ...and the pool bounded in tokens, not by that fraction of the machine.
    assert value_after(cmd, "--max-total-tokens") == [str(CPU_KV_TOKENS)]
    gpu = build_command(spec(cpu=False), 1)
    assert "--max-total-tokens" not in gpu and "--mem-fraction-static" not in gpu


def test_a_capturing_cpu_servers_kv_pool_holds_the_window_at_the_longest_prompt():
    from actors.sglang.engine import SGLangEngine
    from conf.schema import SGLangEngineConfig

    def pool(cfg, cuda=False, capture=True, longest=2048):
        kwargs = SGLangEngine.kwargs_for(cfg, "/m", (1,), cuda, 2, capture=capture, max_prompt_tokens=longest)
        cmd = build_command(ServerSpec(dump_dir=Path("/d"), **kwargs["spec_without_dump"]), 1)
        return value_after(cmd, "--max-total-tokens") if "--max-total-tokens" in cmd else []

    # Every request of the window at the longest prompt, with its one new token: none waits for room.
    assert pool(SGLangEngineConfig(max_in_flight=16)) == [str(16 * 2049)]
    assert pool(SGLangEngineConfig(max_in_flight=3), longest=100) == ["303"]
    # Within the cap, yet never below one prompt of the longest length (which the cap alone could refuse).
    assert pool(SGLangEngineConfig(max_in_flight=64), longest=8192) == [str(CPU_KV_TOKENS)]
    assert pool(SGLangEngineConfig(max_in_flight=4), longest=2 * CPU_KV_TOKENS) == [str(2 * CPU_KV_TOKENS + 1)]
    # A generation server decodes: it keeps the default pool; a GPU server sizes its own; a user's flag wins.
    assert pool(SGLangEngineConfig(), capture=False) == [str(CPU_KV_TOKENS)]
    assert pool(SGLangEngineConfig(), cuda=True) == []
    assert pool(SGLangEngineConfig(server_flags=("--max-total-tokens", "4096"))) == ["4096"]
    assert pool(SGLangEngineConfig(), longest=None) == [str(CPU_KV_TOKENS)]


@pytest.mark.parametrize(
    "flags, fraction",
    [
        (("--mem-fraction-static", "0.3"), None),
        (("--mem-fraction-static=0.3",), None),
        (("--max-total-tokens", "4096"), CPU_MEM_FRACTION),
    ],
)
def test_user_memory_flags_replace_the_defaults(flags, fraction):
    cmd = build_command(spec(cpu=True, extra_flags=flags), 1)
    names = [f.split("=")[0] for f in cmd]
    # One fraction: the user's, or ours beside their token cap; never our cap beside their flag.
    assert names.count("--mem-fraction-static") == 1
    assert (CPU_MEM_FRACTION in cmd) == (fraction is not None)
    assert names.count("--max-total-tokens") <= 1 and str(CPU_KV_TOKENS) not in cmd


def test_idle_servers_sleep():
    # An idle SGLang scheduler otherwise polls its sockets at 100 % of a core.
    assert "--sleep-on-idle" in build_command(spec(cpu=True), 1)
    assert "--sleep-on-idle" in build_command(spec(cpu=False), 1)


def test_env_puts_hook_first_and_standin_only_on_cpu(monkeypatch):
    monkeypatch.setenv("PYTHONPATH", "/already/there")
    cpu = build_env(spec(cpu=True))["PYTHONPATH"].split(os.pathsep)
    assert cpu[0] == str(PATCH_ROOT / "sitedir")
    assert str(PATCH_ROOT / "cpu_standin") in cpu
    assert cpu[-1] == "/already/there"
    gpu = build_env(spec(cpu=False))["PYTHONPATH"].split(os.pathsep)
    assert gpu[0] == str(PATCH_ROOT / "sitedir")
    assert not any("cpu_standin" in p for p in gpu)


def test_env_hook_variables(monkeypatch):
    monkeypatch.delenv("PYTHONPATH", raising=False)
    monkeypatch.delenv("SGLANG_USE_CPU_ENGINE", raising=False)
    env = build_env(spec(cpu=True, env={"EXTRA": "1"}))
    assert env["HIDDEN_HARVEST_DUMP_DIR"] == "/dev/shm/d"
    assert env["HIDDEN_HARVEST_RID_PREFIX"] == RID_PREFIX
    assert env["SGLANG_USE_CPU_ENGINE"] == "1"
    assert env["HIDDEN_HARVEST_PARENT_PID"] == str(os.getpid())  # the server's watchdog follows this process
    assert env["EXTRA"] == "1"
    assert "" not in env["PYTHONPATH"].split(os.pathsep)
    assert "SGLANG_USE_CPU_ENGINE" not in build_env(spec(cpu=False))


def test_a_cpu_server_gets_the_malloc_settings_as_a_set_unless_the_user_set_any(monkeypatch):
    for key in [k for k in os.environ if k.startswith("MALLOC_")]:
        monkeypatch.delenv(key)
    cpu = build_env(spec(cpu=True))
    assert {k: cpu[k] for k in CPU_MALLOC_ENV} == CPU_MALLOC_ENV
    assert int(cpu["MALLOC_MMAP_THRESHOLD_"]) <= 32 * 2**20  # glibc ignores a larger one on 64-bit
    assert not any(k.startswith("MALLOC_") for k in build_env(spec(cpu=False)))
    # One of glibc's own set by the user (or the spec): none of ours, since the trim threshold alone is harmful.
    assert not any(
        k.startswith("MALLOC_")
        for k in build_env(spec(cpu=True, env={"MALLOC_ARENA_MAX": "2"}))
        if k != "MALLOC_ARENA_MAX"
    )
    monkeypatch.setenv("MALLOC_TRIM_THRESHOLD_", "1")
    env = build_env(spec(cpu=True))
    assert env["MALLOC_TRIM_THRESHOLD_"] == "1" and "MALLOC_MMAP_THRESHOLD_" not in env


def test_nothing_of_the_server_listens_beyond_loopback(monkeypatch):
    monkeypatch.delenv("NCCL_SOCKET_IFNAME", raising=False)
    monkeypatch.delenv("GLOO_SOCKET_IFNAME", raising=False)
    assert value_after(build_command(spec(), port=1), "--host") == ["127.0.0.1"]
    assert build_env(spec(cpu=True))["HIDDEN_HARVEST_LOOPBACK"] == "1"  # torch's rendezvous store (patches/)
    gpu = build_env(spec(cpu=False))
    assert gpu["NCCL_SOCKET_IFNAME"] == gpu["GLOO_SOCKET_IFNAME"] == "lo"


def test_the_rendezvous_store_binds_loopback_only(hook_modules):
    import datetime
    import importlib
    import sys

    import psutil

    sys.modules.pop("hidden_harvest_loopback", None)
    loopback = importlib.import_module("hidden_harvest_loopback")
    import torch.distributed  # noqa: F401 -- `torch.distributed.rendezvous` the attribute is a function; take the module

    rdzv = sys.modules["torch.distributed.rendezvous"]

    original = rdzv._create_c10d_store
    try:
        loopback.install_import_hook()
        from tests_support import free_ports

        port = free_ports(1)[0]
        store = rdzv._create_c10d_store("127.0.0.1", port, 0, 1, datetime.timedelta(seconds=10))
        store.set("k", "v")
        assert store.get("k") == b"v"
        listening = {
            (c.laddr.ip, c.laddr.port)
            for c in psutil.Process().net_connections("inet")
            if c.status == psutil.CONN_LISTEN
        }
        assert ("127.0.0.1", port) in listening and not [a for a in listening if a[1] == port and a[0] != "127.0.0.1"]
        del store
    finally:
        rdzv._create_c10d_store = original


def test_a_server_start_that_fails_is_tried_once_more_then_gives_up(monkeypatch, tmp_path):
    """A start that stalls or exits (EngineDied from the server) gets a fresh process once; a second failure
    fails the actor, so Ray's wait for actors (which covers every attempt) never outlives the engine's."""
    from actors.engine import EngineDied
    from actors.sglang import engine as engine_mod

    monkeypatch.setattr(engine_mod, "default_dump_root", lambda: tmp_path)
    starts: list[int] = []

    def failing_start(fail_times):
        def start(self):
            starts.append(1)
            if len(starts) <= fail_times:
                raise EngineDied(f"SGLang server not ready (attempt {len(starts)})")
            return self

        return start

    kwargs = {"model_dir": Path("/models/m"), "aux_layers": (1,), "startup_timeout_s": 1.0}
    monkeypatch.setattr(engine_mod.SGLangEngine, "_warm_up", lambda self: None)  # no server to warm
    monkeypatch.setattr(engine_mod.SGLangServer, "start", failing_start(1))
    engine = engine_mod.SGLangEngine(kwargs, max_in_flight=2, request_timeout_s=5).start()
    engine.close()
    assert len(starts) == engine_mod.SGLangEngine.start_attempts == 2

    starts.clear()
    monkeypatch.setattr(engine_mod.SGLangServer, "start", failing_start(2))
    with pytest.raises(EngineDied, match="attempt 2"):
        engine_mod.SGLangEngine(kwargs, max_in_flight=2, request_timeout_s=5).start()
    assert len(starts) == 2


AVX2 = "processor\t: 0\nmodel name\t: AMD EPYC\nflags\t\t: fpu sse2 avx avx2 fma\n"
AMX = "processor\t: 0\nmodel name\t: Intel Xeon\nflags\t\t: fpu avx2 avx512f avx512_bf16 amx_bf16 amx_tile\n"
ARM_BF16 = "processor\t: 0\nFeatures\t: fp asimd bf16 i8mm\n"


@pytest.mark.parametrize(
    "cpuinfo,native",
    [(AVX2, False), (AMX, True), (ARM_BF16, True), ("processor\t: 0\n", None)],
    ids=["avx2", "amx", "arm-bf16", "unknown"],
)
def test_bf16_matmul_is_read_off_the_cpus_flags(cpuinfo, native):
    from actors.cpu import cpu_has_bf16_matmul

    assert cpu_has_bf16_matmul(cpuinfo) is native


def test_cpu_dtype_auto_computes_in_float32_only_where_bf16_is_not_native_and_the_user_did_not_choose():
    from actors.sglang.server import cpu_dtype_flags

    assert cpu_dtype_flags("auto", (), AVX2) == ("--dtype", "float32")
    assert cpu_dtype_flags("auto", (), AMX) == ()
    assert cpu_dtype_flags("auto", (), "") == ()  # cannot tell: SGLang's own choice
    assert cpu_dtype_flags("model", (), AVX2) == ()
    assert cpu_dtype_flags("float32", (), AMX) == ("--dtype", "float32")
    for user in (("--dtype", "bfloat16"), ("--dtype=bfloat16",)):
        assert cpu_dtype_flags("auto", user, AVX2) == cpu_dtype_flags("float32", user, AMX) == ()


def test_the_cpu_dtype_reaches_the_servers_command_and_never_a_gpu_server(monkeypatch):
    from actors.sglang import engine as engine_mod
    from conf.schema import SGLangEngineConfig

    monkeypatch.setattr("actors.sglang.server.cpu_has_bf16_matmul", lambda cpuinfo=None: False)
    cfg = SGLangEngineConfig(server_flags=("--log-level", "warning"))
    cpu = engine_mod.SGLangEngine.kwargs_for(cfg, "/models/m", (1,), cuda=False, cpu_threads=2)
    cmd = build_command(ServerSpec(dump_dir=Path("/d"), **cpu["spec_without_dump"]), port=1)
    assert value_after(cmd, "--dtype") == ["float32"] and value_after(cmd, "--log-level") == ["warning"]
    gpu = engine_mod.SGLangEngine.kwargs_for(cfg, "/models/m", (1,), cuda=True, cpu_threads=2)
    assert "--dtype" not in build_command(ServerSpec(dump_dir=Path("/d"), **gpu["spec_without_dump"]), port=1)


def test_a_generation_only_server_has_no_capture_and_keeps_the_prefix_cache():
    cmd = build_command(spec(capture=False, prefix_cache=True), 1)
    assert "--enable-return-aux-hidden-states" not in cmd and "--speculative-algorithm" not in cmd
    assert "--disable-radix-cache" not in cmd  # nothing is captured, so a cached prefix truncates nothing
    # A plain baseline (capture off) still computes every position unless asked: benchmarks repeat prompts.
    assert "--disable-radix-cache" in build_command(spec(capture=False), 1)
    with pytest.raises(ValueError, match="prefix_cache"):
        spec(prefix_cache=True)  # a capture with a cached prefix would dump only its uncached tail
    from actors.sglang.engine import SGLangEngine
    from conf.schema import SGLangEngineConfig

    kwargs = SGLangEngine.generation_kwargs(SGLangEngineConfig(), "/m", False, 2, 48)
    assert kwargs["spec_without_dump"]["prefix_cache"] is True
    assert (
        SGLangEngine.kwargs_for(SGLangEngineConfig(), "/m", (1,), False, 2)["spec_without_dump"]["prefix_cache"]
        is False
    )
    env = build_env(spec(capture=False))
    assert "HIDDEN_HARVEST_DUMP_DIR" not in env  # the hook stays off in every server process

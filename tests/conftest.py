"""Session fixtures for end-to-end tests: one local Ray, one small input, one real job run.

The job runs on real components: local Ray, a real SGLang server in CPU mode with the dump hook,
SmolLM2-135M-Instruct, real Parquet on local disk.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from tests_support import References, free_ports

REPO_ROOT = Path(__file__).resolve().parents[1]
SAMPLE = REPO_ROOT / "conf" / "data" / "sample_conversations.jsonl"

os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")


def small_input_lines(n_chat: int = 16) -> list[str]:
    """A fast but varied input: short chats of each shape, pre-tokenized and text rows, bad rows, a duplicate."""
    rows = [json.loads(line) for line in SAMPLE.read_text().splitlines() if line.strip()]

    def size(r):
        return len(json.dumps(r))

    chats = [
        r for r in rows if ("messages" in r or "conversations" in r) and not str(r.get("id", "")).startswith("bad-")
    ]
    chats = sorted(chats, key=size)
    picked = chats[:4] + chats[40 : 40 + n_chat - 4]  # a few tiny ones, then a spread of lengths
    picked += [r for r in rows if "conversations" in r][:2]
    picked += [r for r in rows if "input_ids" in r][:2] + [r for r in rows if "text" in r][:1]
    picked += [r for r in rows if str(r.get("id", "")).startswith("bad-")][:2]
    lines = [json.dumps(r, ensure_ascii=False) for r in picked]
    no_id = next(line for line, r in zip(lines, picked) if "id" not in r)
    return lines + [no_id]  # the same row twice: the second is a duplicate


@pytest.fixture(scope="session")
def model_dir() -> Path:
    from pipeline.intake.model import prepare_default_model

    return prepare_default_model()


@pytest.fixture(scope="session")
def references(model_dir):
    """float32 truth and bf16 yardstick of any token sequence, for judging stored states (tests_support.References)."""
    refs = References(model_dir)
    yield refs
    refs.close()


@pytest.fixture(scope="session")
def s3_endpoint():
    """A real S3 HTTP endpoint (moto's server) on 127.0.0.1, set in the standard AWS environment.

    Started before Ray so that Ray's workers inherit the endpoint and the (fake) credentials.
    """
    from moto.server import ThreadedMotoServer
    from s3_chaos import ChaosProxy

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0)
    server.start()
    host, port = server.get_host_and_port()
    # Everything reaches moto through a proxy that forwards unchanged until a test makes it misbehave (s3_chaos).
    proxy = ChaosProxy(f"http://{host}:{port}")
    url = proxy.url
    env = {
        "AWS_ENDPOINT_URL": url,
        "AWS_ACCESS_KEY_ID": "hh-test-key",
        "AWS_SECRET_ACCESS_KEY": "hh-test-secret",
        "AWS_DEFAULT_REGION": "us-east-1",
    }
    old = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    _S3["proxy"], _S3["direct"] = proxy, f"http://{host}:{port}"
    yield url
    proxy.close()
    server.stop()
    for k, v in old.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


_S3: dict = {}


@pytest.fixture(scope="session")
def s3_chaos(s3_endpoint):
    """(the proxy every S3 call of the session goes through, moto's own URL for looking behind it)."""
    return _S3["proxy"], _S3["direct"]


@pytest.fixture(scope="session")
def ray_session(s3_endpoint):
    import ray

    ray.init(
        num_cpus=2,
        object_store_memory=300 * 2**20,
        include_dashboard=False,
        log_to_driver=False,
        _metrics_export_port=free_ports(1)[0],
    )
    yield ray
    ray.shutdown()


@pytest.fixture(scope="session")
def e2e_input(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("input") / "small.jsonl"
    path.write_text("\n".join(small_input_lines()) + "\n")
    return path


def e2e_config(input_path, output_path, **sets):
    from conf import load_config

    overrides = [
        f"input.path={input_path}",
        f"output.path={output_path}",
        "extract.batch_size=8",
        "progress.interval_s=2",
    ]
    if sets.get("engine.name", "sglang") == "sglang":  # a knob of the SGLang engine's only (conf/schema.py)
        overrides.append("engine.max_in_flight=4")
    overrides += [f"{k}={v}" for k, v in sets.items()]
    return load_config(REPO_ROOT / "conf" / "default.yaml", overrides)


@pytest.fixture(scope="session")
def make_config():
    return e2e_config


@pytest.fixture(scope="session")
def harvest_run(ray_session, e2e_input, tmp_path_factory):
    """(output path, summary) of one real job over the small input."""
    from pipeline.driver.job import run

    out = tmp_path_factory.mktemp("harvest") / "out"
    summary = run(e2e_config(e2e_input, out))
    return out, summary


@pytest.fixture(scope="session")
def harvest_run_fp8(ray_session, e2e_input, tmp_path_factory):
    """(output path, summary) of the same job with output.encoding=fp8 (quantized in the server)."""
    from pipeline.driver.job import run

    out = tmp_path_factory.mktemp("harvest-fp8") / "out"
    return out, run(e2e_config(e2e_input, out, **{"output.encoding": "fp8"}))


@pytest.fixture(scope="session")
def harvest_output(harvest_run) -> str:
    return str(harvest_run[0])


@pytest.fixture
def copy(harvest_run, tmp_path) -> Path:
    """A private copy of the shared output, for tests that damage or rewrite it."""
    import shutil

    out, _ = harvest_run
    dst = tmp_path / "copy"
    shutil.copytree(out, dst)
    return dst


@pytest.fixture(scope="session")
def harvest_run_fp32(ray_session, e2e_input, tmp_path_factory):
    """The job with the server computing in float32 (bf16 only for storage), on three chats of the small input."""
    from pipeline.driver.job import run

    chats = [line for line in e2e_input.read_text().splitlines() if '"messages"' in line and '"bad-' not in line]
    path = tmp_path_factory.mktemp("input32") / "three.jsonl"
    path.write_text("\n".join([chats[0], chats[len(chats) // 2], chats[-1]]) + "\n")
    out = tmp_path_factory.mktemp("harvest32") / "out"
    summary = run(e2e_config(path, out, **{"engine.server_flags": "[--dtype, float32]"}))
    return out, summary

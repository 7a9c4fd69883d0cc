"""The engine wrapper against a real SGLang server: realignment by id, truncation traps, restart, close,
and the server's own parent-death watchdog."""

from __future__ import annotations

import os
import signal
import stat
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

from actors.cpu import cpu_has_bf16_matmul
from actors.sglang.engine import SGLangEngine
from actors.validate import check_capture
from pipeline.driver.plan import default_aux_layers

pytestmark = pytest.mark.slow


# The job's default layers for the model (30 layers): (1, 14, 26), HF hidden_states[2, 15, 27].
AUX = default_aux_layers(30)


@pytest.fixture(scope="module")
def engine(model_dir):
    """A server that names no layers: SGLang's own EAGLE-3 default capture. Every capture of it is checked
    against float32 HF states of the job's default layers (AUX), so these tests also pin our default to the
    layers EAGLE-3 serving reads when a draft config names none (a neighbouring layer fails the rule)."""
    eng = SGLangEngine(
        {"model_dir": model_dir, "aux_layers": (), "cpu": True, "startup_timeout_s": 600},
        max_in_flight=4,
        request_timeout_s=300,
    )
    # Started from a thread that ends at once: the server must outlive the thread that started it
    # (Ray runs the stage's batches on threads; any of them may restart the server).
    starter = threading.Thread(target=eng.start)
    starter.start()
    starter.join()
    yield eng
    eng.close()


def _ids(n: int, seed: int) -> list[int]:
    return [(seed * 7919 + i * 104729) % 49000 + 100 for i in range(n)]


def test_results_are_realigned_by_id_and_repeats_are_not_truncated(engine, references):
    requests = {"long": _ids(900, 1), "short": _ids(5, 2), "mid": _ids(300, 3)}
    # The same prompt twice: with a prefix cache the second would come back as its uncached suffix only.
    requests["mid-again"] = list(requests["mid"])
    results = engine.capture(list(requests.items()))
    assert set(results) == set(requests)
    for key, ids in requests.items():
        res = results[key]
        assert res.error is None, res.error
        assert check_capture(res.capture, ids, 3 * 576, 576) is None
        assert res.capture.header.prefix_len == 0 and res.capture.header.nonfinite == 0
        assert res.capture.aux.shape == (2, 3 * 576, len(ids)) and res.capture.last.shape == (2, 576, len(ids))
        # Each its own prompt's states, the repeat too: within bf16 noise of a float32 forward of the prompt.
        # (Not bit for bit: the two may run in different forwards, whose bf16 rounding differs.)
        references.check(key, AUX, ids, *res.capture.bits())
    assert engine.healthy()
    assert not [p for p in engine.spec.dump_dir.iterdir() if p.suffix == ".hhd"]  # every dump consumed
    # The window's clock counts the job's requests only (warm-up is start-up), and none is left in flight.
    window = engine.stats()["window"]
    assert window["requests"] >= len(requests) and window["size"] == 4
    assert 0 < window["mean_in_flight"] <= 4 and window["short_of_full_s"] <= window["seconds"]


def test_the_server_listens_on_loopback_only_and_dumps_into_a_private_directory(engine):
    import psutil

    server = psutil.Process(engine.server._proc.pid)
    group = [server] + server.children(recursive=True)
    listening = [c.laddr for p in group for c in p.net_connections(kind="inet") if c.status == psutil.CONN_LISTEN]
    assert listening and {a.ip for a in listening} <= {"127.0.0.1", "::1"}, listening
    dump_dir = engine.spec.dump_dir
    assert stat.S_IMODE(dump_dir.stat().st_mode) == 0o700 and dump_dir.name.startswith("hidden-harvest-")
    assert server.environ()["HIDDEN_HARVEST_DUMP_DIR"] == str(dump_dir)


def test_a_killed_server_is_restarted(engine):
    old_pid = engine.server._proc.pid
    os.killpg(old_pid, signal.SIGKILL)
    deadline = time.monotonic() + 30
    while engine.healthy() and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not engine.healthy()
    engine.ensure_alive()
    assert engine.healthy() and engine.server._proc.pid != old_pid
    res = engine.capture([("after", _ids(50, 4))])["after"]
    assert res.error is None and check_capture(res.capture, _ids(50, 4), 3 * 576, 576) is None


_ORPHAN = """
import sys, time
from pathlib import Path
from actors.sglang.server import SGLangServer, ServerSpec
server = SGLangServer(ServerSpec(model_dir=Path(sys.argv[1]), aux_layers=(2, 15, 27), dump_dir=Path(sys.argv[2]))).start()
print(server._proc.pid, flush=True)
time.sleep(3600)
"""


def test_server_dies_with_the_process_that_started_it(model_dir, tmp_path):
    """A starter killed by force (no teardown) leaves no server behind: the server's watchdog ends it."""
    dump_dir = tmp_path / "dumps"
    starter = subprocess.Popen(
        [sys.executable, "-c", _ORPHAN, str(model_dir), str(dump_dir)],
        stdout=subprocess.PIPE,
        text=True,
        cwd=os.path.dirname(os.path.dirname(os.path.dirname(__file__))),
    )
    server_pid = int(starter.stdout.readline())
    os.kill(starter.pid, signal.SIGKILL)
    starter.wait()
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            os.killpg(server_pid, 0)
        except ProcessLookupError:
            break
        time.sleep(0.5)
    else:
        os.killpg(server_pid, signal.SIGKILL)
        pytest.fail("the SGLang server outlived its starter by 60 s")
    assert not dump_dir.exists()  # the watchdog removes the private dump directory too


def test_prompts_longer_than_a_prefill_chunk_come_out_whole_and_pre_norm(engine, model_dir, references):
    """Chunked prefill stays on: the hook assembles the chunks by request id, mixed with short prompts in
    the same batches; both it and the unchunked capture of the module's engine are within bf16 noise of a
    float32 forward. This server dumps the final layer before the norm (the job's default), judged against
    transformers' last decoder layer output; where both servers ran the same forward (prompts shorter than a
    chunk: their aux layers agree bit for bit), our norm of it agrees with the module engine's post-norm
    state, per-token cosine >= 0.9999 (the bit-identical share is printed). Leaving the engine's `with`
    block (close()) stops its server and removes its private dump directory."""
    from pipeline.format.final_norm import read_final_norm

    requests = {
        "long-a": _ids(700, 11),
        "short-a": _ids(9, 12),
        "long-b": _ids(333, 13),
        "short-b": _ids(64, 14),
        "long-c": _ids(130, 15),
    }
    spec = {"model_dir": model_dir, "aux_layers": AUX, "cpu": True, "chunked_prefill_size": 128}
    with SGLangEngine(spec | {"final_layer": "pre_norm"}, 4, 300) as chunked:
        got = chunked.capture(list(requests.items()))
        proc, dump_dir = chunked.server._proc, chunked.spec.dump_dir
    assert proc.poll() is not None
    assert not dump_dir.exists()
    # Chunk size 8192, every prompt in one pass; and SGLang's default layers where `chunked` names ours.
    want = engine.capture(list(requests.items()))
    norm = read_final_norm(model_dir)
    same = total = 0
    for key, ids in requests.items():
        assert got[key].error is None, got[key].error
        assert check_capture(got[key].capture, ids, 3 * 576, 576, "pre_norm") is None  # count, hash, shapes, finite
        assert check_capture(want[key].capture, ids, 3 * 576, 576, "post_norm") is None
        references.check(f"{key} chunked, pre-norm", AUX, ids, *got[key].capture.bits(), final_layer="pre_norm")
        references.check(f"{key} unchunked, SGLang's default layers", AUX, ids, *want[key].capture.bits())
        (g_aux, g_pre), (w_aux, w_post) = got[key].capture.bits(), want[key].capture.bits()
        if len(ids) < 128:
            # One forward each, the same tokens unchunked. Bit for bit only where the matmuls do not depend on
            # the batch they run in: a CPU with native bf16 matmul (AMX) blocks them by the batch's row count,
            # so a prompt batched with other requests differs within bf16 noise (both checked against the
            # float32 reference above), and our norm then sees slightly different inputs.
            exact = not cpu_has_bf16_matmul()
            if exact:
                assert (g_aux == w_aux).all(), f"{key}: one forward each, the same tokens unchunked: the same bits"
            post = norm.apply_bits(g_pre)
            f32 = [(b.astype(np.uint32) << 16).view(np.float32).astype(np.float64) for b in (post, w_post)]
            cos = (f32[0] * f32[1]).sum(-1) / (np.linalg.norm(f32[0], axis=-1) * np.linalg.norm(f32[1], axis=-1))
            assert cos.min() >= (0.9999 if exact else 0.999), (key, cos.min())
            same, total = same + int((post == w_post).sum()), total + post.size
    print(f"our norm of SGLang's pre-norm state vs SGLang's post-norm state: {same / total:.2%} bit-identical")

"""Where the host's time goes while it launches one forward of the hf engine, on a CUDA machine.

  python bench/probes/profile_forward_host.py --work DIR --tokenizer TOKENIZER_DIR [--shape 8b] [--out FILE.json]

Written when the engine's own counter (`fill_floor_launch_ms`) put a launch at 118-433 ms against ~0.4 s of
device time for a full 16k-token forward. It measures the launch with the device idle before each call, so
nothing queued earlier is waited for (bench/results/forward_host_h200.json: 26-44 ms for the 8B shape; the
counter had included waits on CUDA's full launch queue behind earlier forwards):

1. host seconds to launch one forward (the call returning, nothing waited for) per shape, beside the
   device's own seconds for it, for: the plain decoder (no hooks), the decoder with the engine's keep hooks,
   and the whole engine path (hooks, the per-layer device clock, staging);
2. torch.profiler over one launch of the largest shape on the plain decoder and on the engine path: the ops
   by host self time and the CUDA runtime calls (launches, allocations, synchronizations) by count and time.
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

SHAPES_TO_TIME = [(1, 256), (1, 2048), (4, 2048), (8, 2048)]


def launch_and_device_s(fn, repeats: int = 3) -> tuple[float, float]:
    """(best host seconds for `fn()` to return, device seconds of the same call) with the device idle before."""
    import torch

    host, device = [], []
    for _ in range(repeats):
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        t0 = time.perf_counter()
        start.record()
        fn()
        end.record()
        host.append(time.perf_counter() - t0)
        end.synchronize()
        device.append(start.elapsed_time(end) / 1000)
    return min(host), min(device)


def profile_table(fn, rows: int = 25) -> dict:
    """Host self time by op, and the CUDA runtime calls, over one call of `fn` (after a synchronize)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    events = prof.key_averages()
    ops = sorted(events, key=lambda e: e.self_cpu_time_total, reverse=True)
    runtime = [e for e in ops if e.key.startswith(("cuda", "cu"))]
    return {
        "host_self_ms_total": round(sum(e.self_cpu_time_total for e in ops) / 1000, 2),
        "top_ops_by_host_self_ms": [
            {"op": e.key, "calls": e.count, "self_ms": round(e.self_cpu_time_total / 1000, 3)} for e in ops[:rows]
        ],
        "cuda_runtime_calls": [
            {"call": e.key, "calls": e.count, "self_ms": round(e.self_cpu_time_total / 1000, 3)} for e in runtime
        ],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--work", required=True)
    ap.add_argument("--tokenizer", required=True)
    ap.add_argument("--shape", default="8b")
    ap.add_argument("--out", default="bench/results/forward_host_h200.json")
    args = ap.parse_args()

    import torch

    from actors.hf.engine import HFEngine, _Request
    from bench.bench_job_gpu import make_model
    from pipeline.driver.plan import default_aux_layers
    from pipeline.intake.model import num_hidden_layers

    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    model_dir = make_model(work, args.shape, Path(args.tokenizer), "cuda")
    aux = default_aux_layers(num_hidden_layers(model_dir))
    eng = HFEngine(str(model_dir), tuple(aux), device="cuda", max_batch_tokens=16384).start()
    result: dict = {
        "benchmark": "host time to launch one hf-engine forward, and where it goes",
        "command": "python bench/probes/profile_forward_host.py "
        + " ".join(a if not a.startswith("/") else "DIR" for a in sys.argv[1:]),
        "machine": torch.cuda.get_device_name(0),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "date": datetime.date.today().isoformat(),
        "shape": args.shape,
        "engine_start": eng.stats().get("start"),
        "launch": {},
    }
    dec = eng.decoder
    vocab = eng.vocab_size
    try:

        def seqs(rows: int, t: int) -> list[list[int]]:
            return [[(r * 31 + j) % vocab for j in range(t)] for r in range(rows)]

        def plain(rows, t):
            def go():
                # Every hook of the engine's (keep, per-layer clock) set aside for this call: the decoder alone.
                saved = [(m, dict(m._forward_pre_hooks), dict(m._forward_hooks)) for m in dec.base.modules()]
                for m, _, _ in saved:
                    m._forward_pre_hooks.clear()
                    m._forward_hooks.clear()
                try:
                    dec.forward(seqs(rows, t), keep=False, pin=True)
                finally:
                    for m, pre, post in saved:
                        m._forward_pre_hooks.update(pre)
                        m._forward_hooks.update(post)

            return go

        def kept(rows, t):
            def go():
                dec.forward(seqs(rows, t), keep=True, pin=True)
                dec.discard()

            return go

        def engine_path(rows, t):
            # The worker thread's own steps (forward with every hook, staging), run on this thread while the
            # worker waits for requests; the staged buffers are dropped instead of copied.
            def go():
                batch = [_Request(f"p{i}", s, None, 0.0) for i, s in enumerate(seqs(rows, t))]
                eng._marks = {}
                ids = eng._forward(batch)
                eng._stage(batch, ids)
                eng._marks = {}

            return go

        for name, make in (("plain_decoder", plain), ("keep_hooks", kept), ("engine_path", engine_path)):
            for rows, t in SHAPES_TO_TIME:
                host, device = launch_and_device_s(make(rows, t))
                result["launch"].setdefault(name, []).append(
                    {"rows": rows, "t": t, "host_ms": round(1000 * host, 2), "device_ms": round(1000 * device, 2)}
                )
                print(f"{name} {rows}x{t}: host {1000 * host:.1f} ms, device {1000 * device:.1f} ms", flush=True)
        rows, t = SHAPES_TO_TIME[-1]
        result["profile_plain_decoder"] = profile_table(plain(rows, t))
        result["profile_engine_path"] = profile_table(engine_path(rows, t))
        for key in ("profile_plain_decoder", "profile_engine_path"):
            p = result[key]
            print(f"{key}: host self {p['host_self_ms_total']} ms", flush=True)
            for row in p["top_ops_by_host_self_ms"][:15]:
                print(f"   {row['self_ms']:9.3f} ms  {row['calls']:6d}  {row['op']}", flush=True)
            for row in p["cuda_runtime_calls"][:10]:
                print(f"   runtime {row['self_ms']:9.3f} ms  {row['calls']:6d}  {row['call']}", flush=True)
    finally:
        eng.close()
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {out}", flush=True)


if __name__ == "__main__":
    main()

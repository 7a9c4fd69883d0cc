"""Why the capturing hf engine's first decoder layer runs long on a CUDA machine: the engine cut down step by step.

  python bench/probes/profile_first_layer_gpu.py --work DIR --tokenizer TOKENIZER_DIR [--prompts 640] [--out FILE.json]

Written after bench/results/benchmix_allocator_h200.json: inside the job every forward's first decoder layer
ran ~24 ms beyond the median layer (2.33 s of 2.35 s of layer excess) while the bare engine's did not, and
the host was less than a layer ahead of the device at the start of 94 of 95 forwards. The same prompts run,
in this process, without Ray, through five engines that differ by one step each:

- bare: bench/bare_hf.py (nothing kept, staged or copied);
- stage: the capture staged on the device (the staging kernels), not copied, results resolved empty;
- copy: staged and copied into pinned memory, results resolved empty;
- full: the capturing engine as the job runs it (copied and resolved into captures), each capture released;
- full+encode: the same, each capture encoded on a 16-thread pool as the actor does (no disk).

Each engine's prompts are cut by a few tokens of their own, so its first pass runs forward shapes new to the
process (as a job's forwards are) and its second the same shapes again. For each pass: tok/s, device us per padded token, the first layer's and the other layers' excess, forwards with
the host under a layer ahead, and the host's own clock at layer 0 and layer 1 (how long the forward thread
took between launching the two: a long time means it was held up inside the first layer). Then
torch.profiler over a few forwards of `full` lists the CUDA runtime calls, and which thread made them.
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


def engines():
    """name -> engine class, each one step from the next."""
    from actors.engine import RequestResult
    from actors.hf.engine import HFEngine
    from bench.bare_hf import BareHFEngine

    def empty(self, staged) -> None:
        now = time.monotonic()
        self.last_done_unix = time.time()
        for r in staged.batch:
            r.future.set_result(RequestResult(r.key, None, None, now - r.submitted))

    class Stage(HFEngine):
        def _copy_to_host(self, staging, bad, end, widths, marks=None):
            return None, None, end  # the finisher waits for the staging to end; nothing crosses to the host

        _resolve = empty

    class Copy(HFEngine):
        _resolve = empty

    return {"bare": BareHFEngine, "stage": Stage, "copy": Copy, "full": HFEngine, "full+encode": HFEngine}


def host_clock(eng) -> tuple[list, list, list]:
    """Host perf_counter at the pre-hooks of layers 0 and 1 of every forward (on the forward thread), and
    whether the device had run everything queued before layer 0 (the host reached the forward with no lead)."""
    import torch

    l0, l1, dry = [], [], []

    def first(*_):
        l0.append(time.perf_counter())
        dry.append(torch.cuda.current_stream().query() if eng.cuda else False)

    eng._hooks += [
        eng.decoder.layers[0].register_forward_pre_hook(first),
        eng.decoder.layers[1].register_forward_pre_hook(lambda *_: l1.append(time.perf_counter())),
    ]
    return l0, l1, dry


def fresh(prompts: list, seed: int) -> list:
    """The prompts each cut by 0-63 tokens at the end: forward shapes this process has not run yet, as every
    forward of a job has (an earlier engine in this process ran the uncut prompts)."""
    import random

    rng = random.Random(seed)
    return [p[: max(16, len(p) - rng.randrange(64))] for p in prompts]


def one(name: str, cls, model_dir: Path, prompts: list, aux: list, batch_tokens: int, passes: int, device: str) -> dict:
    from concurrent.futures import ThreadPoolExecutor, as_completed
    from statistics import median

    from bench.bench_job_gpu import log, us_per_padded_token
    from pipeline.format.codec import Codec

    tokens = sum(map(len, prompts))
    codec = Codec()
    out = {"passes": []}
    # Torch's own attention kernels in every engine (engine.cudnn_attention=always): the five differ by their
    # step alone, and the first pass shows what a new shape costs the library's choice.
    with cls(str(model_dir), tuple(aux), device=device, max_batch_tokens=batch_tokens, cudnn_attention="always") as eng:
        l0, l1, dry = host_clock(eng)
        for f in as_completed([eng.submit(f"w{i}", p) for i, p in enumerate(prompts[:64])]):
            cap = f.result().capture
            if cap is not None:
                cap.release()
        with ThreadPoolExecutor(16) as pool:
            for _ in range(passes):
                eng.reset_stats()
                l0.clear()
                l1.clear()
                dry.clear()
                t0 = time.monotonic()
                jobs = []
                for f in as_completed([eng.submit(f"p{i}", p) for i, p in enumerate(prompts)]):
                    cap = f.result().capture
                    if cap is None:
                        continue
                    if name == "full+encode":
                        jobs.append(pool.submit(lambda c: (c.encode(codec), c.release()), cap))
                    else:
                        cap.release()
                for j in jobs:
                    j.result()
                dt = time.monotonic() - t0
                s = eng.stats()
                gaps = [1000 * (b - a) for a, b in zip(l0, l1)]
                out["passes"].append(
                    {
                        "tok_s": round(tokens / dt, 1),
                        "forwards": s["forwards"],
                        "us_per_padded_token": us_per_padded_token(s),
                        "layer_excess_s": s.get("device_layer_excess_s"),
                        "lead_under_a_layer": s.get("lead_under_a_layer"),
                        "host_layer0_to_layer1_ms_median": round(median(gaps), 3) if gaps else None,
                        "host_layer0_to_layer1_ms_max": round(max(gaps), 3) if gaps else None,
                        "host_layer0_to_layer1_ms_over_5": sum(g > 5 for g in gaps),
                        "forwards_reached_with_the_device_dry": sum(dry),
                        "engine": s,
                    }
                )
                log(f"{name}: {json.dumps({k: v for k, v in out['passes'][-1].items() if k != 'engine'})}")
        if eng.cuda:
            out["profile"] = profile(eng, fresh(prompts[:160], 99))
    return out


def profile(eng, prompts: list) -> dict:
    """torch.profiler over a few forwards of the running engine (shapes new to the process): the CUDA runtime
    calls, the attention op the dispatcher chose (its name says the backend) and the device's top kernels."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for f in [eng.submit(f"q{i}", p) for i, p in enumerate(prompts)]:
            cap = f.result().capture
            if cap is not None:
                cap.release()
        torch.cuda.synchronize()
    runtime, attention, kernels = {}, {}, {}
    for e in prof.events():
        on_device = e.device_type == torch.autograd.DeviceType.CUDA
        table = (
            kernels
            if on_device
            else runtime
            if e.name.startswith("cu")
            else attention
            if "scaled_dot_product" in e.name
            else None
        )
        if table is None:
            continue
        took = e.device_time_total if on_device else e.cpu_time_total
        c = table.setdefault(e.name, [0, 0.0, 0.0])
        c[0] += 1
        c[1] += took
        c[2] = max(c[2], took)

    def rows(table: dict, most: int) -> list:
        return [
            {"name": k[:120], "calls": v[0], "total_ms": round(v[1] / 1000, 3), "max_ms": round(v[2] / 1000, 3)}
            for k, v in sorted(table.items(), key=lambda kv: -kv[1][1])[:most]
        ]

    return {
        "cuda_runtime_calls": rows(runtime, 20),
        "attention_ops_host": rows(attention, 10),
        "device_kernels": rows(kernels, 15),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--work", type=Path, required=True)
    ap.add_argument("--tokenizer", type=Path, required=True)
    ap.add_argument("--shape", default="8b")
    ap.add_argument("--prompts", type=int, default=640)
    ap.add_argument("--batch-tokens", type=int, default=16384)
    ap.add_argument("--passes", type=int, default=2)
    ap.add_argument("--device", default="cuda", help="cpu: a smoke run of the script itself")
    ap.add_argument(
        "--sdp", choices=("default", "no-cudnn"), default="default", help="no-cudnn: SDPA without cuDNN attention"
    )
    ap.add_argument("--engines", default="bare,stage,copy,full,full+encode")
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "first_layer_gpu.json")
    args = ap.parse_args()

    import torch

    from bench.bench_job_gpu import log, make_model, make_prompts
    from pipeline.driver.plan import default_aux_layers
    from pipeline.intake.model import num_hidden_layers

    if args.sdp == "no-cudnn":
        torch.backends.cuda.enable_cudnn_sdp(False)
    args.work.mkdir(parents=True, exist_ok=True)
    model_dir = make_model(args.work, args.shape, args.tokenizer, args.device)
    vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    _, prompts = make_prompts(args.work, args.prompts, 128, 2048, vocab)
    aux = default_aux_layers(num_hidden_layers(model_dir))
    result = {
        "benchmark": "the capturing hf engine cut down step by step, in one process without Ray (first-layer wait)",
        "machine": f"1 x {torch.cuda.get_device_name(0)}" if args.device == "cuda" else platform.processor(),
        "python": platform.python_version(),
        "date": datetime.date.today().isoformat(),
        "command": " ".join(["python", "bench/probes/profile_first_layer_gpu.py", *sys.argv[1:]]),
        "prompts": {"count": len(prompts), "tokens": sum(map(len, prompts)), "lengths": "uniform 128-2048"},
        "max_batch_tokens": args.batch_tokens,
        "torch": torch.__version__,
        "sdp": args.sdp,
        "engines": {},
    }
    classes = engines()
    for k, name in enumerate(args.engines.split(",")):
        # Pass 1 runs shapes new to the process, pass 2 the same again (the bare engine's warm passes).
        mine = fresh(prompts, k)
        result["engines"][name] = one(
            name, classes[name], model_dir, mine, aux, args.batch_tokens, args.passes, args.device
        )
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1) + "\n")
    log(f"wrote {args.out}")


if __name__ == "__main__":
    main()

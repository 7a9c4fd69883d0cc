"""The data path at GPU speed, measured in one run on a CUDA machine (no SGLang or Ray needed there).

  python bench/bench_data_path_gpu.py [--out bench/results/data_path_h200.json] [--disk-dir DIR]
  python bench/bench_data_path_gpu.py --device cpu --scale 0.02 --out /tmp/x.json     (a smoke run)

1. Hook vs forward: a batch of 32 requests of 256-4096 tokens (~73.6k tokens), K=3 aux layers. The project's
   real hook (DumpPublisher.capture, as the patched LogitsProcessor.forward calls it, with a stand-in
   ForwardBatch) runs on CUDA tensors of that batch; its cost is the wall time from before the call until the
   forward stream has finished the work it queued (plane split, non-finite count), against the forward time of
   a random-init Llama-3-8B-shape model body on the same requests (sdpa, bf16): `hook_over_forward` (target
   <= 0.03). The side stream's copy to the host and the writer's publication rate are reported beside it.
   In situ: the same model over every request without and with the hook on its real hidden states
   (`in_situ_hook_over_forward`). Also at H=7168 (hook only).
2. The actor's path from dump to committed shard: the dumps the hook published (in /dev/shm), read
   (memory-mapped), validated from their headers, encoded with a pool of N threads and committed as a
   shard (fsync'd) by the project's own code, into /dev/shm and onto the disk; `actor_raw_GB_s` is raw bf16
   bytes / wall time (target >= 2.0), `ratio_vs_raw` the committed size over raw. Also with two batches
   at once (the actor's default `engine.batches_per_actor: 2`).
3. The disk's own write bandwidth from the same run (one and eight writers, fsync'd), for scale.
Values are activation-like bf16 (per-channel log-normal scales, a few outlier channels).
"""

from __future__ import annotations

import argparse
import datetime
import importlib
import json
import os
import platform
import shutil
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor, as_completed
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from actors.dump import dump_path, read_dump  # noqa: E402
from actors.validate import check_capture  # noqa: E402
from pipeline.format.shards import EncodedSample, ShardLayout, ShardWriter  # noqa: E402
from pipeline.format.storage import Store  # noqa: E402

K = 3
LLAMA3_8B = dict(
    hidden_size=4096,
    intermediate_size=14336,
    num_hidden_layers=32,
    num_attention_heads=32,
    num_key_value_heads=8,
    vocab_size=128256,
    max_position_embeddings=8192,
    rope_theta=500000.0,
)


def load_hook():
    """The hook's publisher, as the patched server imports it (no SGLang needed)."""
    sys.path.insert(0, str(ROOT / "patches" / "sglang" / "v0_5_23" / "sitedir"))
    return importlib.import_module("hidden_harvest_publisher")


def lengths(scale: float) -> list[int]:
    rng = np.random.default_rng(0)
    lens = np.sort(rng.integers(256, 4097, 32))
    lens = (lens * 73_623 / lens.sum()).astype(int)  # the FACTS batch: 73,623 tokens
    return [max(8, int(n * scale)) for n in lens]


def activation_like(rows: int, width: int, device, seed: int) -> torch.Tensor:
    g = torch.Generator(device="cpu").manual_seed(seed)
    scale = torch.exp(torch.randn(width, generator=g))
    scale[torch.randperm(width, generator=g)[: max(1, width // 100)]] *= 50
    x = torch.empty(rows, width, dtype=torch.bfloat16, device=device)
    for i in range(0, rows, 8192):  # in slices: a float32 [rows, width] would not fit beside the model
        n = min(8192, rows - i)
        x[i : i + n] = (torch.randn(n, width, generator=g) * scale).to(device, torch.bfloat16)
    return x


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def forward_seconds(hook, lens, device, layers: int | None, dump_dir: Path, repeats: int) -> dict:
    """The 8B-shape model body on each request, without and with the hook on its real hidden states."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(**{**LLAMA3_8B, **({"num_hidden_layers": layers} if layers else {})}, attn_implementation="sdpa")
    n_layers = cfg.num_hidden_layers
    aux_ids = (2, n_layers // 2, n_layers - 3) if n_layers > 3 else tuple(range(min(K, n_layers)))
    torch.manual_seed(0)
    with torch.device(device):
        model = LlamaForCausalLM(cfg).to(torch.bfloat16).eval()
    ids = [torch.randint(0, cfg.vocab_size, (1, n), device=device) for n in lens]
    publisher = hook.DumpPublisher(str(dump_dir), "hh-")
    times = {"bare": [], "hooked": []}
    with torch.no_grad():
        for rep in range(repeats + 1):
            for mode in ("bare", "hooked"):
                sync(device)
                t0 = time.perf_counter()
                for i, x in enumerate(
                    ids
                ):  # the model body: what runs before the logits processor, where the hook sits
                    hs = model.model(x, output_hidden_states=True).hidden_states
                    if mode == "hooked":
                        aux = [hs[j + 1][0] for j in aux_ids]
                        publisher.capture(x[0], hs[-1][0], aux, [f"hh-fwd-{i}"], [x.shape[1]], [0])
                sync(device)
                dt = time.perf_counter() - t0
                publisher.flush()
                for p in dump_dir.glob("hh-fwd-*"):
                    p.unlink()
                if rep > 0:  # the first round warms up kernels and pins the host buffers
                    times[mode].append(dt)
    del model, publisher
    if device.type == "cuda":
        torch.cuda.empty_cache()
    bare, hooked = min(times["bare"]), min(times["hooked"])
    return {
        "forward_s": bare,
        "forward_with_hook_s": hooked,
        "forward_tok_s": sum(lens) / bare,
        "in_situ_hook_over_forward": (hooked - bare) / bare,
    }


def hook_seconds(hook, lens, hidden: int, device, dump_dir: Path, repeats: int) -> dict:
    rows = sum(lens)
    aux = [activation_like(rows, hidden, device, seed=i) for i in range(K)]
    last = activation_like(rows, hidden, device, seed=K)
    ids = torch.randint(0, 128000, (rows,), device=device)
    publisher = hook.DumpPublisher(str(dump_dir), "hh-")
    runs, publish = [], []
    for rep in range(repeats + 1):
        rids = [f"hh-{hidden}-{rep}-{i}" for i in range(len(lens))]
        batch = SimpleNamespace(rids=rids, extend_seq_lens_cpu=lens, extend_prefix_lens_cpu=[0] * len(lens))
        sync(device)
        t0 = time.perf_counter()
        publisher.capture(ids, last, aux, batch.rids, batch.extend_seq_lens_cpu, batch.extend_prefix_lens_cpu)
        t_call = time.perf_counter() - t0
        if device.type == "cuda":
            torch.cuda.current_stream().synchronize()  # what the forward stream spends on the hook
        t_stream = time.perf_counter() - t0
        sync(device)
        t_copy = time.perf_counter() - t0  # ... and the side stream's copy to the host
        publisher.flush()
        t_pub = time.perf_counter() - t0
        if rep > 0:  # the first call pins the host buffers (once per server)
            runs.append((t_call, t_stream, t_copy))
            publish.append(t_pub)
            if rep < repeats:
                for r in rids:
                    dump_path(dump_dir, r).unlink()
    raw = rows * (K + 1) * hidden * 2
    call, stream, copy = (min(r[i] for r in runs) for i in range(3))
    return {
        "tokens": rows,
        "raw_bytes": raw,
        "hook_call_s": call,
        "hook_s": stream,
        "hook_us_per_token": stream / rows * 1e6,
        "hook_call_us_per_token": call / rows * 1e6,
        "copy_done_s": copy,
        "copy_GB_s": raw / copy / 1e9,
        "published_s": min(publish),
        "writer_GB_s": raw / min(publish) / 1e9,
        "rids": rids,
        "ids": np.split(ids.cpu().numpy(), np.cumsum(lens)[:-1]),
    }


def actor_path(
    dump_dir: Path, rids: list[str], ids: list[list[int]], hidden: int, out_dir: Path, threads: int, batches: int
) -> dict:
    layout = ShardLayout(tuple(range(K)), hidden)
    store = Store(str(out_dir))
    pool = ThreadPoolExecutor(threads)
    groups = [list(zip(rids, ids))[i::batches] for i in range(batches)]

    def encode(rid, ids, cap):  # HiddenStateExtractor._encode
        try:
            aux, last = cap.encode(layout.codec)
            return EncodedSample(rid, ids, [1] * len(ids), aux, last)
        finally:
            cap.release()

    def one_batch(group, results):  # what HiddenStateExtractor does with each capture (actors/extractor.py)
        encoding = []
        t0 = time.perf_counter()
        for rid, ids in group:
            cap = read_dump(dump_path(dump_dir, rid))
            reason = check_capture(cap, ids, layout.aux_width, hidden)
            assert reason is None, reason
            encoding.append(pool.submit(encode, rid, ids, cap))
        with ShardWriter(store, layout) as shard:
            for f in as_completed(encoding):  # row groups are written while later samples still encode
                shard.add(f.result())
            t1 = time.perf_counter()
            results.append((*shard.commit(), t1 - t0, time.perf_counter() - t1))

    results: list = []
    t0 = time.perf_counter()
    workers = [threading.Thread(target=one_batch, args=(g, results)) for g in groups]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    dt = time.perf_counter() - t0
    pool.shutdown()
    raw = sum(map(len, ids)) * (K + 1) * hidden * 2
    stored = sum(r[1] for r in results)
    for r in results:
        store.remove(r[0])
    return {
        "threads": threads,
        "batches": batches,
        "seconds": dt,
        "actor_raw_GB_s": raw / dt / 1e9,
        "ratio_vs_raw": stored / raw,
        "encode_and_write_s": max(r[2] for r in results),
        "commit_tail_s": max(r[3] for r in results),
    }


def disk_write_GB_s(directory: Path, total: int, writers: int) -> float:
    block = np.random.default_rng(0).integers(0, 255, 64 << 20, dtype=np.uint8)

    def write(i):
        with open(directory / f"bw-{i}", "wb") as f:
            for _ in range(max(1, total // writers // block.size)):
                f.write(block)
            f.flush()
            os.fsync(f.fileno())

    t0 = time.perf_counter()
    with ThreadPoolExecutor(writers) as ex:
        list(ex.map(write, range(writers)))
    dt = time.perf_counter() - t0
    written = writers * max(1, total // writers // block.size) * block.size
    for i in range(writers):
        (directory / f"bw-{i}").unlink()
    return written / dt / 1e9


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="bench/results/data_path_h200.json")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--scale", type=float, default=1.0, help="fraction of the batch's tokens (smoke runs)")
    ap.add_argument("--layers", type=int, default=None, help="decoder layers of the 8B-shape model (default: all 32)")
    ap.add_argument("--disk-dir", default=None, help="a directory on the disk (default: a temp dir beside the repo)")
    ap.add_argument("--threads", default="1,4,8,16")
    ap.add_argument(
        "--batches", default="1,2,4", help="batches encoded and committed at once (engine.batches_per_actor)"
    )
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    device = torch.device(args.device)
    lens = lengths(args.scale)
    hook = load_hook()
    shm = Path(tempfile.mkdtemp(prefix="hh-bench-", dir="/dev/shm"))
    disk = Path(tempfile.mkdtemp(prefix="hh-bench-", dir=args.disk_dir or ROOT))
    result = {
        "command": "python bench/bench_data_path_gpu.py " + " ".join(sys.argv[1:]),
        "machine": (torch.cuda.get_device_name() if device.type == "cuda" else "CPU")
        + f", {os.cpu_count()} CPU cores, {platform.machine()}",
        "date": datetime.date.today().isoformat(),
        "requests": len(lens),
        "tokens": sum(lens),
        "aux_layers": K,
        "torch": torch.__version__,
    }
    try:
        f = forward_seconds(hook, lens, device, args.layers, shm, max(1, args.repeats - 1))
        result.update(f)
        fwd = f["forward_s"]
        print(
            f"forward (Llama-3-8B shape, {sum(lens):,} tokens): {fwd:.3f} s = {f['forward_tok_s']:,.0f} tok/s; "
            f"with the hook on every request {f['forward_with_hook_s']:.3f} s ({f['in_situ_hook_over_forward']:+.4f})",
            flush=True,
        )
        for hidden in (4096, 7168):
            h = hook_seconds(hook, lens, hidden, device, shm, args.repeats)
            rids, ids = h.pop("rids"), [x.tolist() for x in h.pop("ids")]
            result[f"hook_H{hidden}"] = h
            print(
                f"hook H={hidden}: {h['hook_us_per_token']:.3f} us/token on the forward stream ({h['hook_call_us_per_token']:.3f} in the call), "
                f"side-stream copy {h['copy_GB_s']:.1f} GB/s, writer publishes {h['writer_GB_s']:.2f} GB/s",
                flush=True,
            )
            if hidden == 4096:
                result["hook_over_forward"] = h["hook_s"] / fwd
                print(f"hook_over_forward = {result['hook_over_forward']:.4f} (target <= 0.03)", flush=True)
                paths = []
                for where, d in (("shm", shm / "out"), ("disk", disk / "out")):
                    for threads in [int(t) for t in args.threads.split(",")]:
                        for batches in [int(b) for b in args.batches.split(",")]:
                            r = actor_path(shm, rids, ids, hidden, d, threads, batches)
                            r["target"] = where
                            paths.append(r)
                            print(
                                f"actor path -> {where}: {threads:2d} threads, {batches} batch(es): {r['actor_raw_GB_s']:.2f} GB/s raw, "
                                f"ratio {r['ratio_vs_raw']:.4f} (encode + write {r['encode_and_write_s']:.2f} s, then commit {r['commit_tail_s']:.2f} s)",
                                flush=True,
                            )
                result["actor_path"] = paths
                best = max((p for p in paths if p["target"] == "shm"), key=lambda p: p["actor_raw_GB_s"])
                best_disk = max((p for p in paths if p["target"] == "disk"), key=lambda p: p["actor_raw_GB_s"])
                result.update(
                    actor_raw_GB_s=best["actor_raw_GB_s"],
                    threads=best["threads"],
                    batches=best["batches"],
                    ratio_vs_raw=best["ratio_vs_raw"],
                    actor_raw_GB_s_disk=best_disk["actor_raw_GB_s"],
                    threads_disk=best_disk["threads"],
                    batches_disk=best_disk["batches"],
                )
            for r in rids:
                dump_path(shm, r).unlink(missing_ok=True)
        total = min(4 << 30, int(sum(lens) * 32 * 1024 * 0.7))
        result["disk_write_GB_s"] = {
            "1_writer": disk_write_GB_s(disk, total, 1),
            "8_writers": disk_write_GB_s(disk, total, 8),
        }
        result["shm_write_GB_s"] = {"1_writer": disk_write_GB_s(shm, total, 1)}
        print(f"disk write (fsync): {result['disk_write_GB_s']}; /dev/shm: {result['shm_write_GB_s']}", flush=True)
    finally:
        shutil.rmtree(shm, ignore_errors=True)
        shutil.rmtree(disk, ignore_errors=True)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps({k: v for k, v in result.items() if not isinstance(v, (list, dict))}, indent=2))


if __name__ == "__main__":
    main()

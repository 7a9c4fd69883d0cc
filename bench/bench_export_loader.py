"""How fast an output leaves the shards: `harvest export` to each trainer's layout, and the training loader.

  python bench/bench_export_loader.py [--root /dev/shm/hh-bench] [--samples 192] [--tokens 1024] [--hidden 4096]
                                      [--workers 16] [--repeats 3] [--json bench/results/export_loader_h200.json]

Builds an output with the project's own shard writer (3 aux layers + a pre-norm final layer, planes_zstd,
Gaussian states so the high planes compress as real ones do), then times, in one run:
  export       pipeline.tools.export.export(..., verify=False) into ROOT, per trainer; and the verify pass alone
  loader       HiddenStatesDataset iterated in this process, and through a torch DataLoader with 8 workers
Rates are raw bf16 bytes (tokens x (aux layers + 1) x hidden x 2) per second. For scale, a draft trainer
consumes ~32 KB of hidden states per token (8B target: 4 layers x 4096 x 2 B) at tens of thousands of
tokens per second, i.e. ~1 GB/s.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shutil
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from pipeline.format.final_norm import FinalNorm, to_bf16_bits  # noqa: E402
from pipeline.format.manifest import base_manifest, write_manifest  # noqa: E402
from pipeline.format.shards import ShardLayout, encode_bits, write_shard  # noqa: E402
from pipeline.format.storage import Store  # noqa: E402
from pipeline.tools.export import export  # noqa: E402
from pipeline.tools.loader import HiddenStatesDataset  # noqa: E402


def build(path: Path, samples: int, tokens: int, hidden: int, per_shard: int, workers: int) -> int:
    """An output of `samples` samples; returns its raw bf16 bytes."""
    aux_layers = (1, 15, 28)
    rng = np.random.default_rng(0)
    norm = FinalNorm("rms", 1e-5, rng.uniform(0.5, 2, hidden).astype(np.float32))
    layout = ShardLayout(aux_layers, hidden, final_norm=norm)
    store = Store(str(path))
    base = to_bf16_bits(rng.standard_normal((tokens, (len(aux_layers) + 1) * hidden), dtype=np.float32))

    def shard(j: int):
        batch = []
        for k in range(j * per_shard, min(samples, (j + 1) * per_shard)):
            x = np.roll(base, k, axis=0)  # distinct per sample, no generator cost per byte
            ids = ((np.arange(tokens) * 7 + k) % 32000).tolist()
            mask = [0] * (tokens // 4) + [1] * (tokens - tokens // 4)
            batch.append(encode_bits(f"s{k}", ids, mask, x[:, : layout.aux_width], x[:, layout.aux_width :], layout))
        write_shard(store, batch, layout)

    with ThreadPoolExecutor(workers) as pool:
        list(pool.map(shard, range(-(-samples // per_shard))))
    settings = {"final_layer": "pre_norm", "final_norm": norm.describe(), "last_hidden_state_rows": "all"}
    manifest = base_manifest(str(path), settings, {"aux_layers": list(aux_layers), "hidden_size": hidden}, {})
    write_manifest(store, manifest | {"status": "complete", "totals": {"samples_ok": samples}})
    return samples * tokens * (len(aux_layers) + 1) * hidden * 2


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--root", type=Path, default=Path("/dev/shm/hh-bench"))
    ap.add_argument("--samples", type=int, default=192)
    ap.add_argument("--tokens", type=int, default=1024)
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--per-shard", type=int, default=16)
    ap.add_argument("--workers", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--loader-workers", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=3, help="exports per trainer; the best is the rate")
    ap.add_argument("--json", type=Path, default=ROOT / "bench" / "results" / "export_loader_h200.json")
    args = ap.parse_args()

    shutil.rmtree(args.root, ignore_errors=True)
    src = args.root / "out"
    t0 = time.monotonic()
    raw = build(src, args.samples, args.tokens, args.hidden, args.per_shard, args.workers)
    result = {
        "benchmark": "harvest export to each trainer's layout, and the training loader, in raw bf16 GB/s",
        "machine": f"{platform.machine()}, {os.cpu_count()} cores",
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d"),
        "command": "python bench/bench_export_loader.py " + " ".join(sys.argv[1:]),
        "output": {
            "samples": args.samples,
            "tokens_per_sample": args.tokens,
            "hidden": args.hidden,
            "layers": "3 aux + final (pre-norm)",
            "raw_bf16_bytes": raw,
            "build_seconds": round(time.monotonic() - t0, 1),
        },
        "export": {},
        "loader": {},
        "trainer_consumption_for_scale": "~32 KB/token x tens of thousands of tokens/s = ~1 GB/s (8B target)",
    }
    for trainer in ("speculators", "specforge", "modelopt"):
        dest = args.root / trainer
        runs = []
        for _ in range(args.repeats):  # each into an empty DEST: the machine's page cache and tmpfs vary run to run
            shutil.rmtree(dest, ignore_errors=True)
            t = time.monotonic()
            report = export(str(src), trainer, str(dest), workers=args.workers, verify=False)
            runs.append(time.monotonic() - t)
        seconds = min(runs)
        t = time.monotonic()
        check = export(str(src), trainer, str(dest), workers=args.workers)  # everything present: the verify pass
        verify_seconds = time.monotonic() - t
        assert report.written == args.samples and check.ok, check.text()
        result["export"][trainer] = {
            "seconds": round(seconds, 2),
            "raw_GBps": round(raw / seconds / 1e9, 2),
            "raw_GBps_each_run": [round(raw / r / 1e9, 2) for r in runs],
            "bytes_written": report.bytes_written,
            "verify_seconds": round(verify_seconds, 2),
            "verify_raw_GBps": round(raw / verify_seconds / 1e9, 2),
        }
        print(trainer, result["export"][trainer], flush=True)
        shutil.rmtree(dest)

    import torch

    for final in ("pre_norm", "post_norm"):
        t = time.monotonic()
        n = sum(s["num_tokens"] for s in HiddenStatesDataset(str(src), final=final, buffer_size=16))
        one = time.monotonic() - t
        assert n == args.samples * args.tokens
        ds = HiddenStatesDataset(str(src), final=final, buffer_size=16)
        t = time.monotonic()
        dl = torch.utils.data.DataLoader(ds, batch_size=None, num_workers=args.loader_workers, prefetch_factor=4)
        n = sum(int(s["num_tokens"]) for s in dl)
        many = time.monotonic() - t
        assert n == args.samples * args.tokens
        result["loader"][final] = {
            "one_process_raw_GBps": round(raw / one / 1e9, 2),
            f"dataloader_{args.loader_workers}_workers_raw_GBps": round(raw / many / 1e9, 2),
            "tokens_per_s_one_process": round(n / one),
        }
        print(final, result["loader"][final], flush=True)
    shutil.rmtree(args.root, ignore_errors=True)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()

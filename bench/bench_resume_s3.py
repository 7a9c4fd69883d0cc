"""Resume on object storage: from the start of planning to the first batch ready for an actor, with and without
the committed-ids index, against an output of 10,000 shards and 1,000,000 ids on a real S3 HTTP endpoint (moto).

  python bench/bench_resume_s3.py [--shards 10000] [--ids-per-shard 100] [--out bench/results/resume_s3_cpu.json]

The committed output is built cheaply: each batch commits what the job's resume reads (a shard with its
sample_id and num_tokens columns under the job's deterministic name, an error file for one batch in ten, and
the batch's index entry), through tests_support.commit_fake_batch. The input is the same ids plus 1 % new ones,
as tokenized rows made directly in Ray's object store (tokenizing is the same with or without the index and
is measured by bench_plan_scale.py). Timed, for the same input and output, with the job's functions:
decide_work (listing, committed ids, ledger, duplicates, skip keys) and then the filtered, repartitioned
dataset until its first batch of extract.batch_size rows, i.e. what the actor pool would be handed first.
Four states of the index: one entry per batch (as the actors write them; only with --per-batch), as a run's
driver leaves it (its checkpoints of 256 batches each), compacted into one entry (ids_index.compact), and none
(every shard and error file read, 32 at a time).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import resource
import shlex
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))


def start_moto() -> str:
    import logging

    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # a line per request costs the server's time

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0)
    server.start()
    host, port = server.get_host_and_port()
    os.environ.update(
        AWS_ENDPOINT_URL=f"http://{host}:{port}",
        AWS_ACCESS_KEY_ID="bench-key",
        AWS_SECRET_ACCESS_KEY="bench-secret",
        AWS_DEFAULT_REGION="us-east-1",
    )
    return f"http://{host}:{port}"


def build_output(url: str, shards: int, per_shard: int, threads: int, index: bool = True) -> float:
    from pipeline.format.storage import Store
    from tests_support import commit_fake_batch

    store = Store(url)
    t0 = time.monotonic()
    with ThreadPoolExecutor(threads) as pool:
        list(
            pool.map(
                lambda b: commit_fake_batch(store, b, per_shard, errors=2 if b % 10 == 0 else 0, index=index),
                range(shards),
            )
        )
    return time.monotonic() - t0


def checkpoint_as_the_driver_does(url: str, shards: int, per_shard: int, every: int) -> float:
    """The index as a run's driver leaves it (pipeline/driver/checkpoint.py): its metadata rows folded into one
    entry per `every` shards, the batches' own entries it covers removed."""
    from pipeline.driver.checkpoint import IndexCheckpoint
    from pipeline.format.errors import ERROR_DIR, error_file
    from pipeline.format.shards import SHARD_DIR, ids_digest, shard_name
    from pipeline.format.storage import Store

    store = Store(url)
    sizes = store.list_sizes(SHARD_DIR, ".parquet") | store.list_sizes(ERROR_DIR, ".jsonl")
    t0 = time.monotonic()
    ckpt = IndexCheckpoint(store, every)
    for b in range(shards):
        errors = 2 if b % 10 == 0 else 0
        ids = [f"b{b}-s{j}" for j in range(per_shard)]
        ok = ids[errors:]
        size = sizes[shard_name(ok)]
        statuses = ["error"] * errors + ["ok"] * len(ok)
        nbytes = [0] * errors + [size - (len(ok) - 1)] + [1] * (len(ok) - 1)
        errors_bytes = sizes[error_file(ids_digest(ids))] if errors else 0
        shards_col = [""] * errors + [shard_name(ok)] * len(ok)
        ckpt.add_batch(ids, statuses, [7] * per_shard, nbytes, shards_col, errors_bytes)
    ckpt.flush()
    return time.monotonic() - t0


def tokenized_input(shards: int, per_shard: int, new: int):
    """Tokenized rows (TOKENIZED_SCHEMA) for every committed id and `new` more, in Ray's object store."""
    import pyarrow as pa
    import ray.data

    from pipeline.intake.tokenize import TOKENIZED_SCHEMA

    def block(ids: list[str], first_line: int) -> pa.Table:
        n = len(ids)
        return pa.table(
            {
                "sample_id": ids,
                "source": [f"s3://in/part.jsonl:{first_line + i}" for i in range(n)],
                "input_ids": pa.array([[1, 2, 3, 4]] * n, pa.list_(pa.int32())),
                "loss_mask": pa.array([[1, 1, 1, 1]] * n, pa.list_(pa.uint8())),
                "num_tokens": pa.array([4] * n, pa.int32()),
                "num_masked": pa.array([4] * n, pa.int32()),
                "status": ["ok"] * n,
                "stage": [""] * n,
                "reason": [""] * n,
                "turns": [""] * n,
                "cost_full": pa.array([0] * n, pa.int64()),
                "cost_each": pa.array([0] * n, pa.int64()),
                "unrendered": [""] * n,
            },
            schema=TOKENIZED_SCHEMA,
        )

    ids = [f"b{b}-s{j}" for b in range(shards) for j in range(per_shard)] + [f"new-{i}" for i in range(new)]
    step = 10_000
    blocks = [block(ids[i : i + step], i) for i in range(0, len(ids), step)]
    return ray.data.from_arrow(blocks).materialize()


def resume_once(tokenized, url: str, batch_size: int, threads: int) -> dict:
    from conf.schema import PlanConfig
    from pipeline.driver.work import decide_work, still_to_do
    from pipeline.format.storage import Store

    t0 = time.monotonic()
    work = decide_work(tokenized, Store(url), "auto", PlanConfig(read_threads=threads))
    t_plan = time.monotonic()
    todo = still_to_do(tokenized, work.skip).repartition(target_num_rows_per_block=batch_size, strict=True)
    first = next(iter(todo.iter_batches(batch_format="pyarrow", batch_size=None)))
    t_first = time.monotonic()
    assert first.num_rows and all(s.startswith("new-") for s in first["sample_id"].to_pylist())
    return {
        "to_first_batch_s": round(t_first - t0, 1),
        "plan_s": round(t_plan - t0, 1),
        "first_batch_after_plan_s": round(t_first - t_plan, 1),
        "committed_samples": work.committed_samples,
        "to_do": work.rows,
        "index": {
            "entries": work.index.entries,
            "files": work.index.files,
            "from_index": work.index.from_index,
            "read_from_files": len(work.index.read),
        },
        "driver_peak_rss_mb_so_far": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024),
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shards", type=int, default=10_000)
    ap.add_argument("--ids-per-shard", type=int, default=100)
    ap.add_argument("--threads", type=int, default=32, help="plan.read_threads")
    ap.add_argument("--per-batch", action="store_true", help="also time the index of one entry per batch")
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "resume_s3_cpu.json")
    args = ap.parse_args()

    import ray
    import s3fs

    from bench.bench_throughput import machine
    from pipeline.format.ids_index import INDEX_DIR, compact
    from pipeline.format.storage import Store

    start_moto()
    s3fs.S3FileSystem().mkdir("bench-resume")
    url = "s3://bench-resume/out"
    result = {
        "benchmark": "resume on S3 (moto server): start of planning to the first batch ready for the actor pool",
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d"),
        "command": shlex.join(["python", "bench/bench_resume_s3.py", *sys.argv[1:]]),
        "machine": machine(),
        "target": "<= 60 s with 10,000 shards and 1,000,000 committed ids",
        "shards": args.shards,
        "committed_ids": args.shards * args.ids_per_shard,
        "read_threads": args.threads,
    }
    # Without --per-batch the batches' own entries are not written: the checkpoints replace them anyway, and
    # on the 2-core machine moto answers ~50 requests/s, so 10,000 more puts are minutes of set-up.
    result["build_output_s"] = round(build_output(url, args.shards, args.ids_per_shard, 32, args.per_batch), 1)
    print(json.dumps(result), flush=True)
    ray.init(num_cpus=2, object_store_memory=1 << 30, include_dashboard=False, log_to_driver=False)
    try:
        new = args.shards * args.ids_per_shard // 100
        tokenized = tokenized_input(args.shards, args.ids_per_shard, new)
        runs = {}
        if args.per_batch:
            runs["index_one_entry_per_batch"] = resume_once(tokenized, url, 32, args.threads)
            print(json.dumps(runs), flush=True)
        result["checkpoint_s"] = round(checkpoint_as_the_driver_does(url, args.shards, args.ids_per_shard, 256), 1)
        runs["index_as_a_killed_run_leaves_it"] = resume_once(tokenized, url, 32, args.threads)
        print(json.dumps(runs), flush=True)
        t0 = time.monotonic()
        compact(Store(url), args.threads)
        result["compact_s"] = round(time.monotonic() - t0, 1)
        runs["index_compacted"] = resume_once(tokenized, url, 32, args.threads)
        print(json.dumps(runs), flush=True)
        s3fs.S3FileSystem().rm(f"bench-resume/out/{INDEX_DIR}", recursive=True)
        runs["no_index"] = resume_once(tokenized, url, 32, args.threads)
        result["runs"] = runs
    finally:
        ray.shutdown()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()

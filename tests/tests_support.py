"""Small helpers shared by tests (importable because pytest puts tests/ on sys.path via conftest)."""

from __future__ import annotations

import gc
import socket
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
SAMPLE_CONVERSATIONS = REPO_ROOT / "conf" / "data" / "sample_conversations.jsonl"


def sample_chats() -> list[dict]:
    """The shipped sample's conversations that a target can regenerate as they are: `messages` chats, none of
    the deliberately bad rows, no tool calls."""
    import json

    rows = [json.loads(line) for line in SAMPLE_CONVERSATIONS.read_text().splitlines() if line.strip()]
    return [
        r
        for r in rows
        if "messages" in r
        and not str(r.get("id", "")).startswith("bad-")
        and not any(m.get("tool_calls") for m in r["messages"])
    ]


def random_bf16(rng, rows: int, cols: int):
    """Random finite bf16 bit patterns (uint16 [rows, cols]; the exponent never all ones)."""
    import numpy as np

    bits = rng.integers(0, 1 << 16, size=(rows, cols), dtype=np.uint16)
    return np.where((bits & 0x7F80) == 0x7F80, bits & 0xBFFF, bits).astype(np.uint16)


def random_encoded(layout, prefix: str, n: int, tokens: int, rng) -> list:
    """n encoded samples `{prefix}-{i}` of `tokens` tokens each, random finite states in `layout`, all trained."""
    from pipeline.format.shards import encode_bits

    return [
        encode_bits(
            f"{prefix}-{i}",
            list(range(tokens)),
            [1] * tokens,
            random_bf16(rng, tokens, layout.aux_width),
            random_bf16(rng, tokens, layout.hidden_size),
            layout,
        )
        for i in range(n)
    ]


def processes_matching(needle: str, under: int | None = None, since: float | None = None) -> list:
    """psutil processes whose command line holds `needle`: descendants of pid `under` (every process when
    None), started at or after unix time `since` (any time when None). Processes that vanish are skipped."""
    import psutil

    pool = psutil.Process(under).children(recursive=True) if under is not None else psutil.process_iter()
    found = []
    for p in pool:
        try:
            if needle in " ".join(p.cmdline()) and (since is None or p.create_time() >= since):
                found.append(p)
        except psutil.Error:
            continue
    return found


def make_output(path, aux_layers=(1, 3, 5), final="pre_norm", rows="all", status="complete", shards=3, seed=0, H=16):
    """A small output written by the real shard writer, with its manifest: `shards` shards of 2-4 samples of
    3-9 tokens, random finite states, hidden size H, a final norm (final="pre_norm"). Returns
    ({sample_id: (ids, mask, aux bits, stored last bits)}, the FinalNorm or None)."""
    import numpy as np

    from pipeline.format.final_norm import FinalNorm
    from pipeline.format.manifest import base_manifest, write_manifest
    from pipeline.format.shards import ShardLayout, encode_bits, write_shard
    from pipeline.format.storage import Store

    rng = np.random.default_rng(seed)
    norm = FinalNorm("rms", 1e-5, rng.uniform(0.5, 2, H).astype(np.float32)) if final == "pre_norm" else None
    layout = ShardLayout(tuple(aux_layers), H, last_rows=rows, final_norm=norm)
    store, samples, k = Store(str(path)), {}, 0
    for _ in range(shards):
        batch = []
        for _ in range(int(rng.integers(2, 5))):
            t = int(rng.integers(3, 10))
            ids, mask = rng.integers(0, 1000, t).tolist(), [0] * (t // 2) + [1] * (t - t // 2)
            aux, last = random_bf16(rng, t, layout.aux_width), random_bf16(rng, t, H)
            samples[f"s{k}"] = (ids, mask, aux, last)
            batch.append(encode_bits(f"s{k}", ids, mask, aux, last, layout))
            k += 1
        write_shard(store, batch, layout)
    settings = {"final_layer": layout.final_layer, "last_hidden_state_rows": rows, "aux_layers": list(aux_layers)}
    if norm is not None:
        settings["final_norm"] = norm.describe()
    manifest = base_manifest(str(path), settings, {"aux_layers": list(aux_layers), "hidden_size": H}, {})
    write_manifest(store, manifest | {"status": status, "totals": {"samples_ok": len(samples)}})
    return samples, norm


def free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def sets(*overrides: str) -> list[str]:
    """`--set` arguments for `harvest run`, one per override."""
    return [arg for o in overrides for arg in ("--set", o)]


def harvest_command(input_path, out, *extra: str) -> list[str]:
    """`harvest run` of the default config as a CLI process of its own (its own local Ray on 2 CPUs), small batches."""
    cli = [sys.executable, "-m", "pipeline.cli", "run", str(REPO_ROOT / "conf" / "default.yaml")]
    return (
        cli
        + sets(
            f"input.path={input_path}",
            f"output.path={out}",
            "engine.max_in_flight=4",
            "progress.interval_s=2",
            "ray.num_cpus=2",
            "ray.object_store_memory_mb=300",
        )
        + list(extra)
    )


def stored_blocks(aux, last, k: int) -> list:
    """A sample's stored layers as [T, H] blocks: the K aux layers side by side in `aux`, then the final state."""
    h = last.shape[-1]
    return [aux[:, j * h : (j + 1) * h] for j in range(k)] + [last]


def assert_within_bf16_noise(what: str, got_blocks, truth_blocks, yard_blocks, names=None, depths=None):
    """Each stored layer of one sample against the float32 truth, judged by bf16 forwards of the same tokens
    (the audit's rule, pipeline/tools/fidelity.py; `depths`: the blocks' layer ids, FINAL_DEPTH for the final
    state, by default the order given); returns the deviations so a test can print them."""
    from pipeline.tools.fidelity import DEFAULT_RULE

    names = names or [f"block {j}" for j in range(len(got_blocks))]
    assert len(got_blocks) == len(truth_blocks) == len(yard_blocks) == len(names)
    out = DEFAULT_RULE.judge_layers(got_blocks, truth_blocks, yard_blocks, depths)
    for name, d in zip(names, out):
        assert d.passed, f"{what} {name}: {d.why()}"
    return out


class References:
    """The audit's float32 truth and bf16 yardstick (pipeline.tools.audit.Reference), one per aux-layer set,
    started on first use and kept for the session; results cached by token sequence."""

    def __init__(self, model_dir):
        self.model_dir = model_dir
        self._refs: dict = {}
        self._cache: dict = {}

    def layers(self, aux_layers, sequences, final_layer: str = "post_norm") -> list:
        """[(truth blocks, yardstick blocks)] per sequence, each a list of K aux [T, H] blocks then the final
        (after the final norm, or before it with final_layer="pre_norm")."""
        from pipeline.tools.audit import Reference

        key = (tuple(aux_layers), final_layer)
        if key not in self._refs:
            self._refs[key] = Reference(self.model_dir, key[0], final_layer=final_layer).__enter__()
        todo = [list(s) for s in sequences if (key, tuple(s)) not in self._cache]
        for s, r in zip(todo, self._refs[key].layers(todo) if todo else []):
            self._cache[(key, tuple(s))] = r
        return [self._cache[(key, tuple(s))] for s in sequences]

    def check(self, what: str, aux_layers, ids, aux, last, names=None, final_layer: str = "post_norm"):
        """A stored sample (bits or floats) within bf16 noise of float32, every layer; returns the deviations."""
        ((truth, yard),) = self.layers(aux_layers, [list(ids)], final_layer)
        names = names or [f"aux layer {x}" for x in aux_layers] + ["final"]
        from pipeline.tools.fidelity import FINAL_DEPTH

        blocks = stored_blocks(aux, last, len(aux_layers))
        return assert_within_bf16_noise(what, blocks, truth, yard, names, [*aux_layers, FINAL_DEPTH])

    def close(self) -> None:
        """Free the models (results stay cached); the next `layers()` loads them again."""
        for r in self._refs.values():
            r.close()
        self._refs.clear()
        gc.collect()


def damaged_samples_fail(out, device: str = "cpu", max_samples: int | None = None) -> tuple[dict, dict]:
    """Each sample of a healthy output damaged four ways, judged by the audit's rule against its own reference
        (pipeline.tools.audit.Reference on `device`); asserts every damaged sample fails, the damaged layer among
        its failures. Swapped: the longest other sample's first T rows; shifted: the second aux layer's states in
        the first's place; offset: every row one position late; corrupted: the largest value of the middle token's
        final state with its sign flipped. Returns ({kind: {"samples": caught, "least_excess": the smallest, over
    the samples, of how many times its allowance the damaged sample's worst layer stands}}, the MoE routers)."""
    import numpy as np
    import pyarrow.parquet as pq

    from pipeline.format.manifest import read_manifest
    from pipeline.format.shards import decode_row, list_shards, read_layout
    from pipeline.format.storage import Store
    from pipeline.tools.audit import Reference, judge_sample

    store = Store(str(out))
    manifest = read_manifest(store)
    samples = []
    for rel in list_shards(store):
        table = pq.read_table(store.path(rel))
        meta = read_layout(table.schema)
        samples += [
            decode_row(table, i, meta, as_torch=False, expand_last=False, final="stored") for i in range(table.num_rows)
        ]
    samples = samples[:max_samples]
    assert all("last_hidden_state_positions" not in s for s in samples), "a masked final state: not handled here"
    layers, h = tuple(manifest["aux_layers"]), manifest["hidden_size"]
    final_layer = manifest["data_settings"].get("final_layer", "post_norm")
    with Reference(manifest["model"]["path"], layers, device, final_layer=final_layer) as ref:
        refs = ref.samples([s["input_ids"].tolist() for s in samples])
        routers = dict(ref.routers)

    def damaged(s):
        n = s["num_tokens"]
        donor = max((x for x in samples if x is not s), key=lambda x: x["num_tokens"])
        aux, last = s["aux_hidden_states"], s["last_hidden_state"]
        if donor["num_tokens"] >= n:
            yield "swapped", donor["aux_hidden_states"][:n], donor["last_hidden_state"][:n], None
        if len(layers) > 1:
            shifted = aux.copy()
            shifted[:, :h] = aux[:, h : 2 * h]
            yield "shifted", shifted, last, f"aux layer {layers[0]}"
        yield "offset", np.concatenate([aux[1:], aux[-1:]]), np.concatenate([last[1:], last[-1:]]), None
        bad = last.copy()
        t = n // 2
        c = int(np.argmax(bad[t] & 0x7FFF))  # the largest magnitude (bf16 bits order as magnitudes do)
        bad[t, c] ^= 0x8000  # its sign bit
        yield "corrupted", aux, bad, "final"

    caught: dict[str, dict] = {}
    for s, r in zip(samples, refs):
        for kind, aux, last, layer in damaged(s):
            results = judge_sample({**s, "aux_hidden_states": aux, "last_hidden_state": last}, r, layers, h)
            failed = [x.layer for x in results if not x.passed]
            assert failed, (kind, s["sample_id"])
            assert layer is None or layer in failed, (kind, s["sample_id"], failed)
            excess = max(x.excess for x in results)
            seen = caught.setdefault(kind, {"samples": 0, "least_excess": float("inf")})
            seen["samples"] += 1
            seen["least_excess"] = round(min(seen["least_excess"], excess), 2)
    assert set(caught) >= {"shifted", "offset", "corrupted"} and "swapped" in caught, caught
    return caught, routers


def commit_fake_batch(store, batch: int, ids_per_batch: int, errors: int = 0, index: bool = True) -> list[str]:
    """What one actor batch commits, with only the columns resume reads: a shard of `ids_per_batch - errors`
    ids (sample_id, num_tokens), an error file of `errors` ids and the batch's ids-index entry, under the
    names the job gives them. Returns the batch's ids."""
    import io

    import pyarrow as pa
    import pyarrow.parquet as pq

    from pipeline.format.errors import ErrorRow, error_file, write_errors
    from pipeline.format.ids_index import write_entry
    from pipeline.format.shards import ids_digest, shard_name

    ids = [f"b{batch}-s{j}" for j in range(ids_per_batch)]
    ok, bad = ids[errors:], ids[:errors]
    digest = ids_digest(ids)
    rows = [ErrorRow(sid, f"in.jsonl:{batch}", "error", "extract", "fake") for sid in bad]
    errors_rel = error_file(digest)
    errors_bytes = write_errors(store, errors_rel, rows) if rows else 0
    files = []
    if ok:
        sink = io.BytesIO()
        pq.write_table(pa.table({"sample_id": ok, "num_tokens": pa.array([7] * len(ok), pa.int32())}), sink)
        store.write_bytes(shard_name(ok), sink.getvalue())
        files.append((shard_name(ok), len(sink.getvalue()), [(sid, "ok", 7) for sid in ok]))
    if errors_bytes:
        files.append((errors_rel, errors_bytes, [(r.sample_id, r.status, 0) for r in rows]))
    if index:
        write_entry(store, digest, files)
    return ids

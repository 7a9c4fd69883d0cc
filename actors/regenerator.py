"""The Ray Data stage that regenerates assistant turns: input lines in, committed JSONL parts and metadata rows out.

Like the extractor it owns one engine replica (SGLang's server, or transformers) and is called on several
batches at once from threads of the actor (pipeline/driver/regenerate.py): every batch's requests share the
engine's one generation window, so the window stays full across batch boundaries. Under policy `each` a
conversation's turns go one after another (turn k's prompt holds the regenerated turns before it), while the
other conversations of every batch held keep the window full.

What the intake does (lines to conversations, prompts to token ids, conversations back to rows) comes in as
`codec` (pipeline/intake/conversation.RegenerationCodec, handed over by the driver). A conversation that
cannot be regenerated becomes an error row with its reason (stage `generate`: truncated or empty, per config;
stage `engine`: the request failed after its retries, transient for --retry-errors); a dead engine raises.
"""

from __future__ import annotations

import hashlib
import logging
import os
import socket
import time
from collections import Counter
from concurrent.futures import FIRST_COMPLETED, Future, wait

import pyarrow as pa

from actors.engine import GenerateResult, Generator, generator_class
from pipeline.format.errors import ErrorRow, error_file, write_errors
from pipeline.format.regenerated import PROVENANCE, part_file, write_part
from pipeline.format.shards import ids_digest
from pipeline.format.storage import Store

logger = logging.getLogger(__name__)

REQUIRED_COLUMNS = ("sample_id", "source", "line", "status", "stage", "reason")
RESULT_SCHEMA = pa.schema(
    [
        ("sample_id", pa.string()),
        ("status", pa.string()),
        ("stage", pa.string()),
        ("reason", pa.string()),
        ("turns", pa.int64()),  # turns regenerated
        ("prompt_tokens", pa.int64()),
        ("completion_tokens", pa.int64()),
        ("flagged", pa.bool_()),  # kept with a truncated or empty turn (generate.on_truncated/on_empty=keep)
        ("part", pa.string()),
        ("actor", pa.string()),
        ("engine_ready_unix", pa.float64()),
        ("finished_unix", pa.float64()),
    ]
)


def sample_seed(base: int, sample_id: str, turn: int) -> int:
    """The seed of one request: a function of the configured seed, the sample and the turn only, so a rerun
    samples the same turn whichever actor, batch or attempt it lands in."""
    digest = hashlib.sha256(f"{base}\0{sample_id}\0{turn}".encode()).digest()
    return int.from_bytes(digest[:8], "big") >> 1  # non-negative int64


class Regenerator:
    def __init__(
        self,
        engine_name: str,
        engine_kwargs: dict,
        codec,
        sampling: dict,
        output_url: str,
        provenance: dict,
        on_truncated: str = "error",
        on_empty: str = "error",
        retries: int = 2,
        record_token_ids: bool = False,
    ):
        self.codec = codec.load()  # before any batch thread needs it
        self.sampling = dict(sampling)
        self.store = Store(output_url)
        self.provenance = dict(provenance)
        self.on_truncated, self.on_empty = on_truncated, on_empty
        self.retries = retries
        self.record_token_ids = record_token_ids
        self.engine: Generator = generator_class(engine_name)(**engine_kwargs).start()
        self.actor = f"{socket.gethostname()}:{os.getpid()}"
        self.ready_unix = time.time()

    def close(self) -> None:
        engine = getattr(self, "engine", None)
        if engine is not None:
            engine.close()

    def __del__(self):
        # Ray Data's only teardown hook for a callable-class stage; the engine's lifecycle stays close().
        self.close()

    def __call__(self, batch: pa.Table) -> pa.Table:
        missing = [c for c in REQUIRED_COLUMNS if c not in batch.column_names]
        if missing:
            raise KeyError(f"Regenerator needs columns {missing}, got {batch.column_names}")
        rows = batch.to_pylist()
        errors: dict[str, ErrorRow] = {}
        convs = {}
        for r in rows:
            sid = r["sample_id"]
            if r["status"] != "ok":
                errors[sid] = ErrorRow(sid, r["source"], r["status"], r["stage"], r["reason"])
                continue
            try:
                convs[sid] = self.codec.parse(r["line"])
            except ValueError as e:
                errors[sid] = ErrorRow(sid, r["source"], "error", "parse", str(e))
        turns, failed, spent = self._generate(convs)
        for sid, (stage, reason) in failed.items():
            errors[sid] = ErrorRow(sid, _source(rows, sid), "error", stage, reason)

        sources = {r["sample_id"]: r["source"] for r in rows}
        out_rows = [self._row(convs[sid], sources[sid], turns.get(sid, [])) for sid in convs if sid not in failed]
        # Error file first: a crash between the two leaves these ids decided and the rest to rerun.
        write_errors(self.store, error_file(ids_digest([r["sample_id"] for r in rows])), list(errors.values()))
        part = part_file([r[PROVENANCE]["sample_id"] for r in out_rows]) if out_rows else ""
        write_part(self.store, part, out_rows)
        now = time.time()
        # completion_tokens: every token the engine generated for the conversation, kept or not (throughput).
        results = [
            _result(e.sample_id, e.status, e.stage, e.reason, completion=spent.get(e.sample_id, 0))
            for e in errors.values()
        ]
        for row in out_rows:
            prov = row[PROVENANCE]
            results.append(
                _result(
                    prov["sample_id"],
                    "ok",
                    "",
                    "",
                    len(prov["turns"]),
                    sum(t["prompt_tokens"] for t in prov["turns"]),
                    spent.get(prov["sample_id"], 0),
                    bool(prov["flags"]),
                    part,
                )
            )
        for r in results:
            r.update(actor=self.actor, engine_ready_unix=self.ready_unix, finished_unix=now)
        return pa.Table.from_pylist(results, schema=RESULT_SCHEMA)

    def _row(self, conv, source: str, turns: list[dict]) -> dict:
        row = self.codec.output_row(conv)
        flags = sorted({f for t in turns for f in t.get("flags", ())})
        row[PROVENANCE] = {
            "sample_id": conv.sample_id,
            "source": source,
            **self.provenance,
            "turns": turns,
            "flags": flags,
        }
        return row

    def _generate(self, convs: dict) -> tuple[dict[str, list[dict]], dict[str, tuple[str, str]], Counter]:
        """Every conversation's target turns, in order within a conversation, all conversations at once.
        (per-sample turn records, {sample id: (stage, reason)} of those that failed, tokens generated per sample)."""
        records: dict[str, list[dict]] = {sid: [] for sid in convs}
        spent: Counter = Counter()
        failed: dict[str, tuple[str, str]] = {}
        pending: dict[Future, tuple[str, int, int, int, int]] = {}  # future -> (sid, msg index, attempt, seed, prompt)

        def submit(sid: str, attempt: int = 0) -> None:
            conv = convs[sid]
            i = conv.next_target()
            if i is None:
                return
            try:
                ids = self.codec.prompt_ids(conv, i)
            except ValueError as e:
                failed[sid] = ("generate", f"message {i}: {e}")
                return
            seed = sample_seed(self.sampling["seed"], sid, i)
            fut = self.engine.submit_generate(sid, ids, {**self.sampling, "seed": seed})
            pending[fut] = (sid, i, attempt, seed, len(ids))

        for sid in convs:
            submit(sid)
        while pending:
            done, _ = wait(list(pending), return_when=FIRST_COMPLETED)
            for fut in done:
                sid, i, attempt, seed, prompt = pending.pop(fut)
                res: GenerateResult = fut.result()
                spent[sid] += len(res.output_ids)
                if res.error is not None:
                    if attempt < self.retries:
                        logger.warning("%s message %d: %s; trying again", sid, i, res.error)
                        self.engine.ensure_alive()
                        submit(sid, attempt + 1)
                    else:
                        failed[sid] = ("engine", f"message {i}: {res.error} (after {attempt + 1} attempts)")
                    continue
                problem = self._problem(res)
                if problem is not None and problem[1]:
                    failed[sid] = ("generate", f"message {i}: {problem[0]}")
                    continue
                record = {
                    "message": i,
                    "seed": seed,
                    "finish_reason": res.finish_reason,
                    "prompt_tokens": prompt,
                    "completion_tokens": len(res.output_ids),
                    "flags": [problem[2]] if problem else [],
                }
                if self.record_token_ids:
                    record["output_ids"] = list(res.output_ids)
                records[sid].append(record)
                self.codec.accept(convs[sid], i, res.text, res.finish_reason, prompt, res.output_ids)
                submit(sid)
        return records, failed, spent

    def _problem(self, res: GenerateResult) -> tuple[str, bool, str] | None:
        """(reason, whether it makes an error row, its flag when kept) for a truncated or empty turn."""
        if res.finish_reason == "length":
            reason = f"truncated: the turn reached generate.max_new_tokens={self.sampling['max_new_tokens']}"
            return reason, self.on_truncated == "error", "truncated"
        if not res.text.strip():
            return "empty: the model wrote no text for the turn", self.on_empty == "error", "empty"
        return None


def _source(rows: list[dict], sid: str) -> str:
    return next((r["source"] for r in rows if r["sample_id"] == sid), "")


def _result(sid, status, stage, reason, turns=0, prompt=0, completion=0, flagged=False, part="") -> dict:
    return {
        "sample_id": sid,
        "status": status,
        "stage": stage,
        "reason": reason,
        "turns": turns,
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "flagged": flagged,
        "part": part,
    }

"""CPU stage: JSONL lines -> input_ids + assistant loss mask, or an error row with a reason.

Chat rows go through the target's own chat template (pipeline/intake/render.py) and the `extract.turns`
policy (pipeline/intake/turns.py): one conversation becomes one sample (`full`) or one sample per assistant
turn (`each`, ids `<id>#<k>`), so one input line may yield several rows here.
"""

from __future__ import annotations

import hashlib
import logging
from pathlib import Path

import pyarrow as pa

from pipeline.intake.normalize import BadRow, Sample, parse_line, row_id_fallback
from pipeline.intake.render import TemplateRenderer
from pipeline.intake.turns import ChatEncoder, ChatResult

logger = logging.getLogger(__name__)

TOKENIZED_SCHEMA = pa.schema(
    [
        ("sample_id", pa.string()),
        ("source", pa.string()),
        ("input_ids", pa.list_(pa.int32())),
        ("loss_mask", pa.list_(pa.uint8())),
        ("num_tokens", pa.int32()),
        ("num_masked", pa.int32()),
        ("status", pa.string()),  # ok | error | filtered
        ("stage", pa.string()),
        ("reason", pa.string()),
        # Per input row (repeated on each of its samples), for the plan line and the manifest:
        ("turns", pa.string()),  # the extract.turns policy applied to a chat row: full | each; "" otherwise
        ("cost_full", pa.int64()),  # tokens of the row under `full` and under `each`
        ("cost_each", pa.int64()),
        # Fields the template did not render for this sample (kept out of it), comma-separated.
        ("unrendered", pa.string()),
    ]
)
REQUIRED_COLUMNS = ("source", "line")


class ChatTokenizer:
    """The target's tokenizer and chat encoder, loaded on first use.

    Rows that arrive as token ids need only the vocabulary's size; with `vocab_size` given (the driver knows
    it from planning) a stage that only sees such rows never loads the tokenizer, which takes seconds per
    process (transformers' import and the tokenizer files) against milliseconds for the rows themselves."""

    def __init__(
        self,
        model_dir: str | Path,
        template_kwargs: dict | None = None,
        chat_template: str | None = None,
        vocab_size: int | None = None,
    ):
        self.model_dir, self.template_kwargs, self.chat_template = str(model_dir), template_kwargs, chat_template
        self._vocab_size = vocab_size
        self._tok = self._chat = None

    @property
    def tok(self):
        if self._tok is None:
            from transformers import AutoTokenizer

            tok = AutoTokenizer.from_pretrained(self.model_dir)
            if self.chat_template is not None:
                tok.chat_template = self.chat_template
            self._tok = tok
        return self._tok

    @property
    def chat(self) -> ChatEncoder:
        if self._chat is None:
            self._chat = ChatEncoder(self.tok, TemplateRenderer(self.tok, self.template_kwargs))
        return self._chat

    @property
    def vocab_size(self) -> int:
        return self._vocab_size if self._vocab_size is not None else len(self.tok)

    def encode(self, sample: Sample) -> tuple[list[int], list[int]]:
        """One sample's (ids, mask); a chat row is rendered whole (`full`)."""
        if sample.kind == "tokens":
            bad = [i for i in sample.input_ids if i < 0 or i >= self.vocab_size]
            if bad:
                raise BadRow(f"input_ids outside the vocabulary [0, {self.vocab_size}): {bad[:5]}")
            mask = sample.loss_mask if sample.loss_mask is not None else [1] * len(sample.input_ids)
            return list(sample.input_ids), list(mask)
        if sample.kind == "text":
            ids = self.tok(sample.text)["input_ids"]
            return ids, [1] * len(ids)
        enc = self.chat.full(sample.messages, sample.tools)
        return enc.ids, enc.mask

    def encode_chat(self, sample: Sample, turns: str) -> ChatResult:
        return self.chat.encode(sample.messages, sample.tools, turns)


def tokenizer_facts(model_dir: str | Path) -> tuple[dict[str, str], int]:
    """(hashes that change when tokenization would change: the tokenizer files and the chat template; the
    tokenizer's size), from one load of the tokenizer."""
    model_dir = Path(model_dir)
    h = hashlib.sha256()
    for name in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "merges.txt"):
        if (model_dir / name).is_file():
            h.update(name.encode() + (model_dir / name).read_bytes())
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model_dir))
    template = tok.chat_template or ""
    hashes = {"tokenizer_sha256": h.hexdigest(), "chat_template_sha256": hashlib.sha256(template.encode()).hexdigest()}
    return hashes, len(tok)


class Tokenize:
    """map_batches stage (pyarrow in, pyarrow out): needs columns `source`, `line`; one row in, one or more out."""

    def __init__(
        self,
        model_dir: str,
        max_tokens: int,
        overlength: str,
        id_field: str = "id",
        turns: str = "auto",
        template_kwargs: dict | None = None,
        chat_template: str | None = None,
        vocab_size: int | None = None,
    ):
        self.tokenizer = ChatTokenizer(model_dir, template_kwargs, chat_template, vocab_size)
        self.max_tokens = max_tokens
        self.overlength = overlength
        self.id_field = id_field
        self.turns = turns

    def __call__(self, batch: pa.Table) -> pa.Table:
        missing = [c for c in REQUIRED_COLUMNS if c not in batch.column_names]
        if missing:
            raise KeyError(f"Tokenize needs columns {missing}, got {batch.column_names}")
        rows = []
        for source, line in zip(batch["source"].to_pylist(), batch["line"].to_pylist()):
            rows.extend(self.tokenize_line(source, line))
        return pa.Table.from_pylist(rows, schema=TOKENIZED_SCHEMA)

    def tokenize_line(self, source: str, line: str) -> list[dict]:
        """The rows one input line becomes: one, or one per assistant turn under `each`."""
        try:
            sample = parse_line(line, self.id_field)
        except BadRow as e:
            return [_row(row_id_fallback(line, self.id_field), source, "error", "parse", str(e))]
        if sample.kind != "chat":
            try:
                ids, mask = self.tokenizer.encode(sample)
            except BadRow as e:
                return [_row(sample.sample_id, source, "error", "tokenize", str(e))]
            return [self._finish(sample.sample_id, source, ids, mask)]
        result = self.tokenizer.encode_chat(sample, self.turns)
        extra = {"turns": result.policy, "cost_full": result.cost["full"], "cost_each": result.cost["each"]}
        rows = []
        for s in result.samples:
            sid = sample.sample_id if s.turn is None else f"{sample.sample_id}#{s.turn}"
            if s.encoded is None:
                rows.append(_row(sid, source, "error", "tokenize", s.error, **extra))
            else:
                row = self._finish(sid, source, s.encoded.ids, s.encoded.mask, **extra)
                rows.append(dict(row, unrendered=",".join(s.encoded.unrendered)))
        return rows

    def _finish(self, sid: str, source: str, ids, mask, **extra) -> dict:
        if len(ids) > self.max_tokens:
            if self.overlength == "reject":
                return _row(
                    sid,
                    source,
                    "filtered",
                    "tokenize",
                    f"{len(ids)} tokens > extract.max_tokens={self.max_tokens} (overlength=reject)",
                    **extra,
                )
            ids, mask = ids[: self.max_tokens], mask[: self.max_tokens]
        if not any(mask):
            return _row(sid, source, "filtered", "tokenize", "no token has loss_mask 1", **extra)
        return _row(sid, source, "ok", "", "", ids, mask, **extra)


def _row(sample_id, source, status, stage, reason, ids=(), mask=(), turns="", cost_full=0, cost_each=0) -> dict:
    return {
        "sample_id": sample_id,
        "source": source,
        "input_ids": list(ids),
        "loss_mask": list(mask),
        "num_tokens": len(ids),
        "num_masked": sum(mask),
        "status": status,
        "stage": stage,
        "reason": reason,
        "turns": turns,
        "cost_full": cost_full,
        "cost_each": cost_each,
        "unrendered": "",
    }

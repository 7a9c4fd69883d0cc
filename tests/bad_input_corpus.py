"""A corpus of dirty input: every kind of bad row a user's data holds, between good rows, across several files.

Written out by `write_corpus(dir)` because some of it cannot live in a text file (bytes that are not UTF-8,
a multi-megabyte line). Each bad row carries what the job must make of it: its status, the stage that
rejects it, and a phrase its reason must contain. The phrases are the stable core of each message; the
exact wording belongs to the stage that writes it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

VOCAB_SIZE = 49152  # SmolLM2
MAX_TOKENS = 256  # the corpus runs with extract.max_tokens=256, so over-length rows stay small and fast
LINE_LIMIT_BYTES = 2 * 2**20  # the corpus runs with this read limit (pipeline.intake.read.MAX_LINE_BYTES)


@dataclass(frozen=True)
class Expect:
    status: str  # error | filtered
    stage: str  # one stage, or alternatives "a|b"
    phrase: str  # lower-case, contained in the reason

    def matches(self, row: dict) -> bool:
        return (
            row["status"] == self.status
            and row["stage"] in self.stage.split("|")
            and self.phrase in row["reason"].lower()
        )


def chat(sid, question: str, answer: str, **extra) -> dict:
    row = {"messages": [{"role": "user", "content": question}, {"role": "assistant", "content": answer}], **extra}
    return row if sid is None else {"id": sid, **row}


# Ids that must never become (part of) a path: stored as they are, in the data.
HOSTILE_IDS = ["../../escape", "a/b", "x" * 10_000, "nul\x00inside", "/abs/path", "..", "C:\\windows\\x"]

GOOD = [
    chat("good-1", "What is the capital of France?", "Paris."),
    chat("good-2", "Name a prime number.", "Seven is prime."),
    chat("dup-1", "Say hi.", "Hi!"),
    {"id": "good-tokens", "input_ids": [1, 2, 3, 4, 5, 6, 7, 8], "loss_mask": [0, 0, 0, 1, 1, 1, 1, 1]},
    {"id": "good-text", "text": "A plain text sample, every token trained on."},
    chat(None, "No id here.", "Then one is derived from the content."),
] + [chat(sid, f"Hostile id {i}.", f"Stored as is {i}.") for i, sid in enumerate(HOSTILE_IDS)]

# (line bytes, expectation). Lines are raw bytes: some are not text at all.
BAD: list[tuple[bytes, Expect]] = [
    (b'{"id": "bad-utf8", "messages": [{"role": "user", "content": "caf\xe9"}]}', Expect("error", "read", "utf-8")),
    (b"\xff\xfe\x00\x01 binary junk \x80\x81", Expect("error", "read", "utf-8")),
    (b'{"id": "bad-json", "messages": [', Expect("error", "parse", "json")),
    (b"not json at all", Expect("error", "parse", "json")),
    (b'["a", "list", "not", "an", "object"]', Expect("error", "parse", "object")),
    (b'{"id": "bad-types-messages", "messages": "hello"}', Expect("error", "parse", "messages")),
    (
        b'{"id": "bad-types-content", "messages": [{"role": "user", "content": 5}, {"role": "assistant", "content": "x"}]}',
        Expect("error", "parse", "content"),
    ),
    (b'{"id": ["bad", "id", "type"], "text": "x"}', Expect("error", "parse", "id")),
    (b'{"id": "bad-types-ids", "input_ids": [1, "2", 3]}', Expect("error", "parse", "input_ids")),
    (b'{"id": "bad-missing-fields", "prompt": "q", "answer": "a"}', Expect("error", "parse", "messages")),
    (b'{"id": "bad-empty-messages", "messages": []}', Expect("error", "parse", "messages")),
    (b'{"id": "bad-empty-text", "text": ""}', Expect("error", "parse", "text")),
    (
        json.dumps({"id": "bad-no-assistant", "messages": [{"role": "user", "content": "q"}]}).encode(),
        Expect("error", "parse", "assistant"),
    ),
    (
        json.dumps(
            chat("bad-unknown-role", "q", "a")
            | {"messages": [{"role": "wizard", "content": "q"}, {"role": "assistant", "content": "a"}]}
        ).encode(),
        Expect("error", "parse", "wizard"),
    ),
    (
        json.dumps({"id": "bad-token-too-big", "input_ids": [1, 2, VOCAB_SIZE]}).encode(),
        Expect("error", "tokenize", "vocabulary"),
    ),
    (
        json.dumps({"id": "bad-token-negative", "input_ids": [1, -2, 3]}).encode(),
        Expect("error", "tokenize", "vocabulary"),
    ),
    (
        json.dumps({"id": "bad-overlength", "input_ids": [5] * (MAX_TOKENS + 50)}).encode(),
        Expect("filtered", "tokenize", "max_tokens"),
    ),
    (
        json.dumps({"id": "bad-nothing-trained", "input_ids": [1, 2, 3], "loss_mask": [0, 0, 0]}).encode(),
        Expect("filtered", "tokenize", "loss_mask"),
    ),
    # Inputs Python's JSON parser raises on with something other than a JSON error (a ValueError for an
    # integer over 4,300 digits, a RecursionError): rejected by the parser or, failing that, by the stage.
    (b'{"id": ' + b"9" * 5000 + b', "text": "x"}', Expect("error", "parse|tokenize", "")),
    (b"[" * 100_000 + b"]" * 100_000, Expect("error", "parse|tokenize", "")),
    (
        json.dumps(chat("dup-1", "Say hi again.", "Hi again!")).encode(),
        Expect("filtered", "dedup", "duplicate sample_id"),
    ),
]


def long_lines() -> list[tuple[bytes, Expect]]:
    """A line that parses but is far over max_tokens, and one over the read limit (never held in memory)."""
    text = "word " * 60_000  # ~300 KB of text
    return [
        (json.dumps({"id": "long-text", "text": text}).encode(), Expect("filtered", "tokenize", "max_tokens")),
        (b'{"id": "huge", "text": "' + b"z" * (LINE_LIMIT_BYTES + 10) + b'"}', Expect("error", "read", "limit")),
    ]


@dataclass(frozen=True)
class Corpus:
    pattern: str  # input.path glob
    good_ids: list[str]  # sample ids that must be stored (ids derived from content excluded)
    good_rows: int
    expected: dict[str, Expect]  # source "file:line" -> what the job makes of it
    input_rows: int  # non-blank lines


def write_corpus(root: Path) -> Corpus:
    root.mkdir(parents=True, exist_ok=True)
    good = [json.dumps(r, ensure_ascii=False).encode() for r in GOOD]
    bad = BAD + long_lines()
    # Good and bad interleaved over two files; one file starts with a BOM and has blank lines; an empty file;
    # a file that is not JSONL at all.
    files: dict[str, list[tuple[bytes, Expect | None]]] = {"a.jsonl": [], "b.jsonl": []}
    for i, line in enumerate(good):
        files["a.jsonl" if i % 2 == 0 else "b.jsonl"].append((line, None))
    for i, (line, exp) in enumerate(bad):
        if exp.stage == "dedup":  # after the row it repeats (a.jsonl)
            files["b.jsonl"].append((line, exp))
        else:
            files["a.jsonl" if i % 2 == 0 else "b.jsonl"].insert(1 + i % 5, (line, exp))
    files["c-not-jsonl.jsonl"] = [
        (b"name,age", Expect("error", "parse", "json")),
        (b"alice,30", Expect("error", "parse", "json")),
    ]
    files["d-empty.jsonl"] = []
    expected: dict[str, Expect] = {}
    for name, lines in files.items():
        path = root / name
        body = b"\xef\xbb\xbf" if name == "b.jsonl" else b""
        lineno = 0
        for line, exp in lines:
            if name == "b.jsonl" and lineno == 2:  # a blank line is not a row
                body += b"   \n"
                lineno += 1
            body += line + b"\n"
            lineno += 1
            if exp is not None:
                expected[f"{path}:{lineno}"] = exp
        path.write_bytes(body)
    good_ids = [r["id"] for r in GOOD if "id" in r]
    rows = sum(len(v) for v in files.values())
    return Corpus(str(root / "*.jsonl"), good_ids, len(GOOD), expected, rows)

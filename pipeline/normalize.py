"""Turn one JSONL line into one canonical sample, or a reason why it cannot be one.

Accepted shapes: `messages` (role/content), `conversations` (ShareGPT from/value), `input_ids`
with optional `loss_mask`, or `text`; an optional id field, else a stable id derived from content.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass

ROLES = ("system", "user", "assistant")
_SHAREGPT_ROLES = {"system": "system", "human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant"}


class BadRow(ValueError):
    """The row cannot become a sample; the message is the reason stored in errors/."""


@dataclass(frozen=True)
class Sample:
    sample_id: str
    kind: str  # "chat" | "tokens" | "text"
    messages: tuple[dict, ...] = ()
    input_ids: tuple[int, ...] = ()
    loss_mask: tuple[int, ...] | None = None
    text: str = ""


def content_id(obj) -> str:
    canonical = json.dumps(obj, sort_keys=True, ensure_ascii=False, separators=(",", ":"))
    return "h" + hashlib.sha256(canonical.encode()).hexdigest()[:24]


def _messages(raw, key: str) -> tuple[dict, ...]:
    if not isinstance(raw, list) or not raw:
        raise BadRow(f"`{key}` must be a non-empty list of messages")
    out = []
    for i, m in enumerate(raw):
        if not isinstance(m, dict):
            raise BadRow(f"{key}[{i}] is not an object")
        if key == "conversations":
            role, content = _SHAREGPT_ROLES.get(m.get("from")), m.get("value")
            if role is None:
                raise BadRow(f"{key}[{i}]: unknown speaker {m.get('from')!r} (expected one of {sorted(_SHAREGPT_ROLES)})")
        else:
            role, content = m.get("role"), m.get("content")
            if role not in ROLES:
                raise BadRow(f"{key}[{i}]: unknown role {role!r} (expected one of {list(ROLES)})")
        if not isinstance(content, str):
            raise BadRow(f"{key}[{i}]: content must be a string")
        out.append({"role": role, "content": content})
    if not any(m["role"] == "assistant" for m in out):
        raise BadRow("conversation has no assistant turn, so no token would be trained on")
    return tuple(out)


def _int_list(raw, key: str) -> tuple[int, ...]:
    if not isinstance(raw, list) or not raw or not all(isinstance(x, int) and not isinstance(x, bool) for x in raw):
        raise BadRow(f"`{key}` must be a non-empty list of integers")
    return tuple(raw)


def parse_line(line: str, id_field: str = "id") -> Sample:
    """Parse one JSONL line; raises BadRow with the reason. The id is derived before any rewriting."""
    try:
        row = json.loads(line)
    except json.JSONDecodeError as e:
        raise BadRow(f"not valid JSON: {e.msg} at column {e.colno}") from None
    if not isinstance(row, dict):
        raise BadRow("a row must be a JSON object")
    raw_id = row.get(id_field)
    if raw_id is not None and not isinstance(raw_id, (str, int)):
        raise BadRow(f"`{id_field}` must be a string or an integer")

    if "messages" in row or "conversations" in row:
        key = "messages" if "messages" in row else "conversations"
        msgs = _messages(row[key], key)
        sid = str(raw_id) if raw_id is not None else content_id({"messages": msgs})
        return Sample(sid, "chat", messages=msgs)
    if "input_ids" in row:
        ids = _int_list(row["input_ids"], "input_ids")
        mask = None
        if row.get("loss_mask") is not None:
            mask = _int_list(row["loss_mask"], "loss_mask")
            if len(mask) != len(ids):
                raise BadRow(f"loss_mask has {len(mask)} entries for {len(ids)} input_ids")
            if any(v not in (0, 1) for v in mask):
                raise BadRow("loss_mask values must be 0 or 1")
        sid = str(raw_id) if raw_id is not None else content_id({"input_ids": ids, "loss_mask": mask})
        return Sample(sid, "tokens", input_ids=ids, loss_mask=mask)
    if "text" in row:
        if not isinstance(row["text"], str) or not row["text"]:
            raise BadRow("`text` must be a non-empty string")
        sid = str(raw_id) if raw_id is not None else content_id({"text": row["text"]})
        return Sample(sid, "text", text=row["text"])
    raise BadRow(f"row has none of messages, conversations, input_ids, text (keys: {sorted(row)[:8]})")


def row_id_fallback(line: str, id_field: str = "id") -> str:
    """An id for a row that failed to parse, so its error row is still traceable and unique per content."""
    try:
        row = json.loads(line)
        if isinstance(row, dict) and isinstance(row.get(id_field), (str, int)):
            return str(row[id_field])
    except json.JSONDecodeError:
        pass
    return "h" + hashlib.sha256(line.encode()).hexdigest()[:24]

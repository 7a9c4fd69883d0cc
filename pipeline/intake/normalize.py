"""Turn one JSONL line into one canonical sample, or a reason why it cannot be one.

Accepted shapes: `messages` (OpenAI-style chat), `conversations` (ShareGPT from/value), `input_ids`
with optional `loss_mask`, or `text`; an optional id field, else a stable id derived from content.

Chat messages keep every field they carry, because any of them may be read by a chat template:
`content` (a string; null is allowed on an assistant turn that has `tool_calls`), `reasoning_content`
(aliases `reasoning` and `thinking` are folded into it; `pipeline.intake.render` hands it to the template under
the name the template reads), `tool_calls`, `name`, `tool_call_id`, and anything else. A row-level
`tools` list (or a JSON string holding one) is passed to the template as `tools=`. Inline
`<think>...</think>` in content is left alone: the template decides what it renders.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass

ROLES = ("system", "developer", "user", "assistant", "tool", "function", "ipython")
REASONING_KEY = "reasoning_content"
REASONING_ALIASES = ("reasoning_content", "reasoning", "thinking")
_SHAREGPT_ROLES = {
    "system": "system",
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
    "tool": "tool",
    "observation": "tool",
    "function": "function",
}


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
    tools: tuple[dict, ...] | None = None


def bytes_id(data: bytes) -> str:
    """The id of a row known only by its content: `h` + 24 hex digits of its SHA-256."""
    return "h" + hashlib.sha256(data).hexdigest()[:24]


def content_id(obj) -> str:
    canonical = json.dumps(obj, sort_keys=True, ensure_ascii=False, separators=(",", ":"))
    return bytes_id(canonical.encode())


def _reasoning(m: dict, where: str) -> dict:
    """Fold the reasoning aliases into one key; two different texts would leave one of them untrained."""
    found = {k: m[k] for k in REASONING_ALIASES if m.get(k) is not None}
    if not found:
        return m
    values = set(found.values())
    if len(values) > 1:
        raise BadRow(f"{where}: {sorted(found)} hold different reasoning texts; keep one")
    text = values.pop()
    if not isinstance(text, str):
        raise BadRow(f"{where}: {next(iter(found))} must be a string")
    out = {k: v for k, v in m.items() if k not in REASONING_ALIASES}
    out[REASONING_KEY] = text
    return out


def _check_tool_calls(m: dict, where: str) -> None:
    calls = m.get("tool_calls")
    if calls is None:
        return
    if not isinstance(calls, list) or not all(isinstance(c, dict) for c in calls):
        raise BadRow(f"{where}: tool_calls must be a list of objects")
    if m["role"] != "assistant" and calls:
        raise BadRow(f"{where}: only assistant messages carry tool_calls (role is {m['role']!r})")


def _message(m, i: int, key: str) -> dict:
    where = f"{key}[{i}]"
    if not isinstance(m, dict):
        raise BadRow(f"{where} is not an object")
    if key == "conversations":
        role = _SHAREGPT_ROLES.get(m.get("from"))
        if role is None:
            raise BadRow(f"{where}: unknown speaker {m.get('from')!r} (expected one of {sorted(_SHAREGPT_ROLES)})")
        m = {"role": role, "content": m.get("value"), **{k: v for k, v in m.items() if k not in ("from", "value")}}
    elif m.get("role") not in ROLES:
        raise BadRow(f"{where}: unknown role {m.get('role')!r} (expected one of {list(ROLES)})")
    m = _reasoning(dict(m), where)
    _check_tool_calls(m, where)
    content = m.get("content")
    # OpenAI's shape: an assistant turn that only calls tools has content null.
    if not isinstance(content, str) and not (content is None and m["role"] == "assistant" and m.get("tool_calls")):
        raise BadRow(f"{where}: content must be a string")
    return m


def _messages(raw, key: str) -> tuple[dict, ...]:
    if not isinstance(raw, list) or not raw:
        raise BadRow(f"`{key}` must be a non-empty list of messages")
    out = tuple(_message(m, i, key) for i, m in enumerate(raw))
    if not any(m["role"] == "assistant" for m in out):
        raise BadRow("conversation has no assistant turn, so no token would be trained on")
    return out


def _tools(raw) -> tuple[dict, ...] | None:
    if raw is None:
        return None
    if isinstance(raw, str):  # some datasets store the tool list as a JSON string
        try:
            raw = json.loads(raw)
        except json.JSONDecodeError:
            raise BadRow("`tools` is a string that is not a JSON list of tools") from None
    if not isinstance(raw, list) or not all(isinstance(t, dict) for t in raw):
        raise BadRow("`tools` must be a list of tool objects")
    return tuple(raw) or None


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
        tools = _tools(row.get("tools"))
        if raw_id is not None:
            sid = str(raw_id)
        else:  # rows without tools hash as they always did, so their ids survive this change
            sid = content_id({"messages": msgs, **({"tools": tools} if tools else {})})
        return Sample(sid, "chat", messages=msgs, tools=tools)
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
    return bytes_id(line.encode())

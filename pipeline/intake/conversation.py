"""A conversation as regeneration sees it: which assistant turns the target rewrites, the prompt of each (the
target's chat template through the same renderer extraction uses), and the row written back in the input's own
schema with the new turns in place.

The prompt for turn i is the conversation before it, with every turn already regenerated in its new form,
rendered with the generation prompt: exactly what the target is shown when it answers there. Rows keep every
field they came with; only the regenerated messages change, and a row without an id gains one (the id it was
known by here), so extraction on the regenerated rows keeps the sample ids.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field

import pyarrow as pa

from pipeline.intake.normalize import (
    REASONING_ALIASES,
    REASONING_KEY,
    BadRow,
    Sample,
    bytes_id,
    parse_line,
    row_id_fallback,
)
from pipeline.intake.read import read_rows
from pipeline.intake.render import TemplateRenderer, reasoning_keys

POLICIES = ("last", "each")
THINK_OPEN, THINK_CLOSE = "<think>", "</think>"


@dataclass(frozen=True)
class NewTurn:
    """One generated assistant turn."""

    text: str
    finish_reason: str  # stop | length | abort, as the engine says
    prompt_tokens: int
    output_ids: tuple[int, ...] = ()


@dataclass
class Conversation:
    sample: Sample
    row: dict  # the input row as parsed JSON, written back with the new turns
    key: str  # "messages" or "conversations" (ShareGPT), the schema the row is written back in
    targets: list[int]  # message indices to regenerate, in order
    # Whether the template renders a reasoning field: then a turn's `<think>` text is stored as one.
    reads_reasoning: bool = False
    new: dict[int, NewTurn] = field(default_factory=dict)

    @property
    def sample_id(self) -> str:
        return self.sample.sample_id

    def next_target(self) -> int | None:
        return next((i for i in self.targets if i not in self.new), None)

    def prompt_messages(self, i: int) -> list[dict]:
        """The messages the target answers at message i: those before it, regenerated turns in their new form."""
        return [self._normalized(j) for j in range(i)]

    def _split(self, j: int) -> tuple[str | None, str]:
        text = self.new[j].text
        return split_reasoning(text) if self.reads_reasoning else (None, text)

    def _normalized(self, j: int) -> dict:
        m = self.sample.messages[j]
        if j not in self.new:
            return m
        keep = {k: v for k, v in m.items() if k not in ("content", "tool_calls", *REASONING_ALIASES)}
        reasoning, content = self._split(j)
        return {**keep, "content": content, **({REASONING_KEY: reasoning} if reasoning is not None else {})}

    def output_row(self, id_field: str) -> dict:
        """The input row with the regenerated turns in its own schema (messages or ShareGPT conversations)."""
        raw = [dict(m) for m in self.row[self.key]]
        for i in self.new:
            m = {k: v for k, v in raw[i].items() if k not in ("content", "value", "tool_calls", *REASONING_ALIASES)}
            reasoning, content = self._split(i)
            m["value" if self.key == "conversations" else "content"] = content
            if reasoning is not None:
                m[_reasoning_field(self.row[self.key][i])] = reasoning
            raw[i] = m
        out = dict(self.row)
        out[self.key] = raw
        out.setdefault(id_field, self.sample_id)
        return out


def _reasoning_field(m: dict) -> str:
    """The input's own name for reasoning text (reasoning_content, reasoning or thinking)."""
    return next((a for a in REASONING_ALIASES if a in m), REASONING_KEY)


def split_reasoning(text: str) -> tuple[str | None, str]:
    """(reasoning, answer) of a generated turn that thinks in `<think>...</think>` (the opening tag may be in the
    prompt, as DeepSeek-R1's template puts it); (None, text) for a turn without reasoning."""
    if THINK_CLOSE not in text:
        return None, text
    head, _, tail = text.partition(THINK_CLOSE)
    head = head.strip()
    if head.startswith(THINK_OPEN):
        head = head[len(THINK_OPEN) :]
    return head.strip(), tail.strip()


def regeneration_targets(messages: Sequence[dict], policy: str, tool_turns: bool) -> list[int]:
    """Indices of the assistant messages to regenerate. A turn that calls tools is one the tool results after it
    answer: left as written unless `tool_turns`; under `last` such a final turn leaves nothing to regenerate."""
    if policy not in POLICIES:
        raise ValueError(f"generate.policy {policy!r}: one of {POLICIES}")
    turns = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
    if policy == "last":
        turns = turns[-1:]
    return [i for i in turns if tool_turns or not messages[i].get("tool_calls")]


def parse_conversation(
    line: str, id_field: str, policy: str, tool_turns: bool, reads_reasoning: bool = False
) -> Conversation:
    """One JSONL line as a conversation to regenerate; raises BadRow with the reason."""
    sample = parse_line(line, id_field)
    if sample.kind != "chat":
        raise BadRow("regeneration needs a conversation (`messages` or `conversations`), not token ids or text")
    row = json.loads(line)
    key = "messages" if "messages" in row else "conversations"
    targets = regeneration_targets(sample.messages, policy, tool_turns)
    return Conversation(sample, row, key, targets, reads_reasoning)


class RegenerationCodec:
    """What the regeneration stage needs of the intake, in one picklable object the driver hands it (the stage,
    in actors/, does not import the intake): lines to conversations, prompts to token ids with the target's
    template and `extract.template_kwargs`, conversations back to rows. The tokenizer loads on first use."""

    def __init__(self, model_dir: str, template_kwargs: dict, id_field: str, policy: str, tool_turns: bool):
        self.model_dir, self.template_kwargs = str(model_dir), dict(template_kwargs)
        self.id_field, self.policy, self.tool_turns = id_field, policy, tool_turns
        self._tok = self._renderer = self._reads = None

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_tok": None, "_renderer": None, "_reads": None}

    def load(self) -> RegenerationCodec:
        """Load the tokenizer now: the stage calls this once in its constructor, before its batches run on
        threads (a first import of transformers from two threads at once fails with an ImportError)."""
        _ = self.renderer, self.reads_reasoning
        return self

    @property
    def renderer(self) -> TemplateRenderer:
        if self._renderer is None:
            from transformers import AutoTokenizer

            self._tok = AutoTokenizer.from_pretrained(self.model_dir)
            self._renderer = TemplateRenderer(self._tok, self.template_kwargs)
        return self._renderer

    @property
    def reads_reasoning(self) -> bool:
        """Whether the template renders a reasoning field (then `<think>` text is stored as one)."""
        if self._reads is None:
            template = self.renderer.tok.chat_template or ""
            self._reads = bool(template) and any(k in template for k in reasoning_keys(template))
        return self._reads

    def parse(self, line: str) -> Conversation:
        """Raises BadRow (a ValueError) with the reason."""
        return parse_conversation(line, self.id_field, self.policy, self.tool_turns, self.reads_reasoning)

    def prompt_ids(self, conv: Conversation, i: int) -> list[int]:
        text = self.renderer.render(conv.prompt_messages(i), conv.sample.tools, generation_prompt=True)
        return list(self.renderer.tok(text, add_special_tokens=False)["input_ids"])

    @staticmethod
    def accept(conv: Conversation, i: int, text: str, finish_reason: str, prompt_tokens: int, output_ids) -> None:
        """Message i of `conv` is now this generated turn (later prompts show it)."""
        conv.new[i] = NewTurn(text, finish_reason, prompt_tokens, tuple(output_ids))

    def output_row(self, conv: Conversation) -> dict:
        return conv.output_row(self.id_field)


LINE_SCHEMA = pa.schema(
    [
        ("sample_id", pa.string()),
        ("source", pa.string()),
        ("line", pa.string()),
        ("status", pa.string()),  # ok | error
        ("stage", pa.string()),
        ("reason", pa.string()),
    ]
)


def identify_lines(batch: pa.Table, id_field: str = "id") -> pa.Table:
    """Ray Data stage (pyarrow in, out) before regeneration: each read line with its sample id, or an error row.

    Only the id is decided here (no tokenizer), so the driver can dedup and resume before any engine starts;
    the conversation itself is parsed again by the stage that regenerates it."""
    rows = []
    for source, line, read_error, read_id in read_rows(batch):
        if read_error:
            rows.append(_line_row(read_id or bytes_id(source.encode()), source, "", "error", "read", read_error))
            continue
        try:
            sample = parse_line(line, id_field)
            if sample.kind != "chat":
                raise BadRow("regeneration needs a conversation (`messages` or `conversations`), not token ids or text")
        except BadRow as e:
            rows.append(_line_row(row_id_fallback(line, id_field), source, "", "error", "parse", str(e)))
            continue
        except Exception as e:  # noqa: BLE001 -- one row's failure is that row's error, never the job's
            reason = f"cannot be parsed: {type(e).__name__}: {str(e)[:200]}"
            rows.append(_line_row(row_id_fallback(line, id_field), source, "", "error", "parse", reason))
            continue
        rows.append(_line_row(sample.sample_id, source, line, "ok", "", ""))
    return pa.Table.from_pylist(rows, schema=LINE_SCHEMA)


def _line_row(sid, source, line, status, stage, reason) -> dict:
    return {"sample_id": sid, "source": source, "line": line, "status": status, "stage": stage, "reason": reason}

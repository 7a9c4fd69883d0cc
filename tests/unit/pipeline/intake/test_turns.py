"""extract.turns on chat templates that render history the way today's reasoning and agentic targets do.

The templates (tests/templates/) imitate Llama-3.1, DeepSeek-V3, Qwen3, Kimi-K2, gpt-oss harmony and a
tool-calling template with `{% generation %}` blocks, on the default tokenizer's own special tokens.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pipeline.intake.normalize import parse_line
from pipeline.intake.tokenize import ChatTokenizer, Tokenize

TEMPLATES = Path(__file__).resolve().parents[3] / "templates"
NAMES = sorted(p.stem for p in TEMPLATES.glob("*.jinja"))

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Current weather in a city",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
        },
    }
]
REASONING = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "What is 2+2?"},
    {"role": "assistant", "reasoning_content": "Add two and two.", "content": "4"},
    {"role": "user", "content": "And times 3?"},
    {"role": "assistant", "reasoning_content": "4 times 3 is 12.", "content": "12"},
]
AGENT = [
    {"role": "user", "content": "Weather in Paris?"},
    {
        "role": "assistant",
        "reasoning_content": "I should call the tool.",
        "content": None,
        "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}
        ],
    },
    {"role": "tool", "tool_call_id": "call_1", "name": "get_weather", "content": "18 C, sunny"},
    {"role": "assistant", "reasoning_content": "The tool says 18 C.", "content": "It is 18 C and sunny in Paris."},
    {"role": "user", "content": "Thanks!"},
    {"role": "assistant", "content": "You're welcome."},
]
PLAIN = [
    {"role": "user", "content": "Name a colour."},
    {"role": "assistant", "content": "  Blue.  "},
    {"role": "user", "content": "Another one, with émoji 🚀?"},
    {"role": "assistant", "content": "Green 🌿"},
    {"role": "user", "content": "a trailing user turn is context only"},
]
CONSECUTIVE = [
    {"role": "user", "content": "Quick one: the capital of France?"},
    {"role": "assistant", "content": "Paris.", "reasoning_content": "Easy one."},
    {"role": "assistant", "content": "It has been the capital for centuries."},
    {"role": "user", "content": "Thanks a lot"},
    {"role": "assistant", "content": "Any time."},
]
ASSISTANT_FIRST = [
    {"role": "assistant", "content": "Hi, how can I help?"},
    {"role": "user", "content": "Tell me a joke."},
    {"role": "assistant", "content": "Why did the chicken cross the road?"},
]
CONVERSATIONS = {
    "reasoning": (REASONING, None),
    "agent": (AGENT, TOOLS),
    "plain": (PLAIN, None),
    "consecutive": (CONSECUTIVE, None),
    "assistant_first": (ASSISTANT_FIRST, None),
}
END = {
    "llama31": "<|im_end|>",
    "deepseek_v3": "<|im_end|>",
    "qwen3": "<|im_end|>",
    "kimi_k2": "<|im_end|>",
    "harmony": ("<|endoftext|>", "<|im_end|>", "<empty_output>"),
    "tools_chatml": "<|im_end|>",
}


@pytest.fixture(scope="module")
def tokenizers(model_dir):
    return {n: ChatTokenizer(model_dir, chat_template=(TEMPLATES / f"{n}.jinja").read_text()) for n in NAMES}


def sample(conv: str, sid: str = "c"):
    msgs, tools = CONVERSATIONS[conv]
    return parse_line(json.dumps({"id": sid, "messages": msgs, **({"tools": tools} if tools else {})}))


def masked_spans(tok, ids, mask) -> list[str]:
    spans, cur = [], []
    for i, m in list(zip(ids, mask)) + [(None, 0)]:
        if m:
            cur.append(i)
        elif cur:
            spans.append(tok.decode(cur))
            cur = []
    return spans


def spans_of(ct, result) -> list[list[str]]:
    assert all(s.encoded is not None for s in result.samples), [s.error for s in result.samples]
    return [masked_spans(ct.tok, s.encoded.ids, s.encoded.mask) for s in result.samples]


# What each template's model generated, turn by turn, exactly as the template renders it plus its end token.
EXPECTED = {
    ("qwen3", "reasoning"): (
        "each",
        [
            ["<think>\nAdd two and two.\n</think>\n\n4<|im_end|>"],
            ["<think>\n4 times 3 is 12.\n</think>\n\n12<|im_end|>"],
        ],
    ),
    ("kimi_k2", "reasoning"): (
        "each",
        [["<think>Add two and two.</think>4<|im_end|>"], ["<think>4 times 3 is 12.</think>12<|im_end|>"]],
    ),
    ("harmony", "reasoning"): (
        "each",
        [
            [
                "<filename>analysis<file_sep>Add two and two.<|im_end|><|im_start|>assistant<filename>final<file_sep>4<|endoftext|>"
            ],
            [
                "<filename>analysis<file_sep>4 times 3 is 12.<|im_end|><|im_start|>assistant<filename>final<file_sep>12<|endoftext|>"
            ],
        ],
    ),
    ("llama31", "reasoning"): ("full", [["4<|im_end|>", "12<|im_end|>"]]),
    ("deepseek_v3", "reasoning"): ("full", [["4<|im_end|>", "12<|im_end|>"]]),
    ("tools_chatml", "reasoning"): (
        "full",
        [["<think>Add two and two.</think>\n4<|im_end|>", "<think>4 times 3 is 12.</think>\n12<|im_end|>"]],
    ),
    ("qwen3", "agent"): (
        "each",
        [
            [
                '<think>\nI should call the tool.\n</think>\n\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call><|im_end|>'
            ],
            ["<think>\nThe tool says 18 C.\n</think>\n\nIt is 18 C and sunny in Paris.<|im_end|>"],
            ["<think>\n\n</think>\n\nYou're welcome.<|im_end|>"],
        ],
    ),
    ("harmony", "agent"): (
        "each",
        [
            [
                '<filename>analysis<file_sep>I should call the tool.<|im_end|><|im_start|>assistant to=functions.get_weather<filename>commentary json<file_sep>{"city": "Paris"}<empty_output>'
            ],
            [
                "<filename>analysis<file_sep>The tool says 18 C.<|im_end|><|im_start|>assistant<filename>final<file_sep>It is 18 C and sunny in Paris.<|endoftext|>"
            ],
            ["<filename>final<file_sep>You're welcome.<|endoftext|>"],
        ],
    ),
    ("llama31", "agent"): (
        "full",
        [
            [
                '{"name": "get_weather", "parameters": {"city": "Paris"}}<|im_end|>',
                "It is 18 C and sunny in Paris.<|im_end|>",
                "You're welcome.<|im_end|>",
            ]
        ],
    ),
    ("deepseek_v3", "agent"): (
        "full",
        [
            [
                '<jupyter_start><jupyter_code>function<file_sep>get_weather\n```json\n{"city": "Paris"}\n```<jupyter_text><jupyter_script><|im_end|>',
                "It is 18 C and sunny in Paris.<|im_end|>",
                "You're welcome.<|im_end|>",
            ]
        ],
    ),
    ("llama31", "plain"): ("full", [["Blue.<|im_end|>", "Green 🌿<|im_end|>"]]),
    ("harmony", "assistant_first"): (
        "each",
        [
            ["<filename>final<file_sep>Hi, how can I help?<|endoftext|>"],
            ["<filename>final<file_sep>Why did the chicken cross the road?<|endoftext|>"],
        ],
    ),
    ("kimi_k2", "consecutive"): (
        "each",
        [
            ["<think>Easy one.</think>Paris.<|im_end|>"],
            ["<think></think>It has been the capital for centuries.<|im_end|>"],
            ["<think></think>Any time.<|im_end|>"],
        ],
    ),
    # Qwen3 gives the final turn an empty think block: each turn was generated with one, which `full` hides.
    ("qwen3", "plain"): (
        "each",
        [["<think>\n\n</think>\n\n  Blue.  <|im_end|>"], ["<think>\n\n</think>\n\nGreen 🌿<|im_end|>"]],
    ),
}


@pytest.mark.parametrize("name, conv", sorted(EXPECTED), ids=[f"{n}-{c}" for n, c in sorted(EXPECTED)])
def test_auto_masks_exactly_what_the_model_generated(tokenizers, name, conv):
    policy, expected = EXPECTED[(name, conv)]
    result = tokenizers[name].encode_chat(sample(conv), "auto")
    assert result.policy == policy
    assert spans_of(tokenizers[name], result) == expected


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("conv", sorted(CONVERSATIONS))
@pytest.mark.parametrize("policy", ["auto", "each", "full"])
def test_mask_never_covers_system_user_or_tool_text(tokenizers, name, conv, policy):
    ct = tokenizers[name]
    result = ct.encode_chat(sample(conv), policy)
    msgs, _ = CONVERSATIONS[conv]
    assistants = [m for m in msgs if m["role"] == "assistant"]
    assert len(result.samples) == (len(assistants) if result.policy == "each" else 1)
    for s in result.samples:
        assert s.encoded is not None, s.error
        ids, mask = s.encoded.ids, s.encoded.mask
        text = ct.tok.decode(ids)
        spans = masked_spans(ct.tok, ids, mask)
        assert spans and all(sp.endswith(END[name]) for sp in spans), spans
        masked = "".join(spans)
        for m in msgs:
            if m["role"] != "assistant" and m["content"] in text:
                assert m["content"] not in masked
        trained = assistants if s.turn is None else [assistants[s.turn]]
        for m in trained:
            assert (m["content"] or "").strip() in masked
            # Reasoning is trained on wherever the template renders it for a trained turn.
            r = m.get("reasoning_content")
            if r and r in text:
                assert r in masked


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("conv", sorted(CONVERSATIONS))
def test_each_sample_is_the_prompt_the_model_saw_plus_its_turn(tokenizers, name, conv):
    """Turn k's sample starts with the conversation before it rendered with the generation prompt."""
    ct = tokenizers[name]
    msgs, tools = CONVERSATIONS[conv]
    turns = [i for i, m in enumerate(msgs) if m["role"] == "assistant"]
    result = ct.encode_chat(sample(conv), "each")
    for k, s in enumerate(result.samples):
        assert s.turn == k
        if turns[k] == 0:  # nothing was said before it: no prompt to compare with
            continue
        head = sample(conv).messages[: turns[k]]
        prompt = ct.chat.r.render(head, tools, generation_prompt=True)
        text = ct.tok.decode(s.encoded.ids)
        first = s.encoded.mask.index(1)
        assert text.startswith(prompt) or name == "deepseek_v3"  # V3 drops the header of a tool-call-only turn
        assert ct.tok.decode(s.encoded.ids[:first]) == prompt[: len(ct.tok.decode(s.encoded.ids[:first]))]


def test_full_masks_history_as_rendered_there(tokenizers):
    """Qwen3 drops reasoning before the last user message: `full` trains on the turn as it stands there."""
    ct = tokenizers["qwen3"]
    result = ct.encode_chat(sample("reasoning"), "full")
    assert result.policy == "full"
    assert spans_of(ct, result) == [["4<|im_end|>", "<think>\n4 times 3 is 12.\n</think>\n\n12<|im_end|>"]]
    assert result.samples[0].encoded.unrendered == ("messages[2].reasoning_content",)


def test_full_with_harmony_end_tokens(tokenizers):
    ct = tokenizers["harmony"]
    [spans] = spans_of(ct, ct.encode_chat(sample("reasoning"), "full"))
    assert spans == [
        "<filename>final<file_sep>4<|im_end|>",
        "<filename>analysis<file_sep>4 times 3 is 12.<|im_end|><|im_start|>assistant<filename>final<file_sep>12<|endoftext|>",
    ]


def test_harmony_each_keeps_the_tool_call_reasoning_the_model_saw(tokenizers):
    ct = tokenizers["harmony"]
    result = ct.encode_chat(sample("agent"), "each")
    answer = ct.tok.decode(result.samples[1].encoded.ids)
    # The template drops a tool call's reasoning once a final answer follows; the model answering saw it.
    assert "I should call the tool." in answer
    assert "I should call the tool." not in ct.tok.apply_chat_template(
        list(sample("agent").messages[:4]), tools=TOOLS, tokenize=False
    )


def test_auto_cost_and_choice(tokenizers):
    ct = tokenizers["qwen3"]
    result = ct.encode_chat(sample("reasoning"), "auto")
    assert result.cost["each"] == sum(len(s.encoded.ids) for s in result.samples)
    assert result.cost["full"] == len(ct.encode_chat(sample("reasoning"), "full").samples[0].encoded.ids)
    assert result.cost["each"] > result.cost["full"]


def test_enable_thinking_reaches_the_template(model_dir):
    template = (TEMPLATES / "qwen3.jinja").read_text()
    off = ChatTokenizer(model_dir, {"enable_thinking": False}, chat_template=template)
    msgs = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
    [s] = off.encode_chat(parse_line(json.dumps({"messages": msgs})), "each").samples
    # With thinking off the empty think block is part of the prompt, so it is not trained on.
    assert masked_spans(off.tok, s.encoded.ids, s.encoded.mask) == ["hello<|im_end|>"]
    assert "<think>\n\n</think>\n\n" in off.tok.decode(s.encoded.ids)


def test_template_that_ignores_reasoning_reports_it(tokenizers):
    result = tokenizers["llama31"].encode_chat(sample("reasoning"), "auto")
    assert result.samples[0].encoded.unrendered == ("messages[2].reasoning_content", "messages[4].reasoning_content")
    assert tokenizers["qwen3"].encode_chat(sample("agent"), "auto").samples[0].encoded.unrendered == ()


def test_field_the_template_cannot_render_is_an_error_row_with_its_message(model_dir):
    t = Tokenize(str(model_dir), 2048, "reject", turns="auto", chat_template=(TEMPLATES / "llama31.jinja").read_text())
    calls = [{"type": "function", "function": {"name": n, "arguments": {}}} for n in ("a", "b")]
    line = json.dumps(
        {
            "id": "two-calls",
            "messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": None, "tool_calls": calls}],
        }
    )
    rows = t.tokenize_line("f:1", line)
    assert [r["status"] for r in rows] == ["error"]
    assert rows[0]["sample_id"] == "two-calls" and rows[0]["stage"] == "tokenize"
    assert "This model only supports single tool-calls at once!" in rows[0]["reason"]


@pytest.mark.parametrize("name", NAMES)
def test_every_conversation_is_stored_under_auto(model_dir, name):
    t = Tokenize(str(model_dir), 2048, "reject", turns="auto", chat_template=(TEMPLATES / f"{name}.jinja").read_text())
    for conv in CONVERSATIONS:
        rows = t.tokenize_line(
            f"f:{conv}",
            sample(conv).sample_id
            and json.dumps(
                {"id": conv, "messages": CONVERSATIONS[conv][0], **({"tools": TOOLS} if CONVERSATIONS[conv][1] else {})}
            ),
        )
        assert rows and all(r["status"] == "ok" for r in rows), [r["reason"] for r in rows]
        assert len({r["turns"] for r in rows}) == 1
        if rows[0]["turns"] == "each":
            assert [r["sample_id"] for r in rows] == [f"{conv}#{k}" for k in range(len(rows))]
        else:
            assert [r["sample_id"] for r in rows] == [conv]
        assert all(r["cost_full"] > 0 and r["cost_each"] >= r["cost_full"] for r in rows)


def test_each_ids_are_stable_across_runs(model_dir):
    template = (TEMPLATES / "qwen3.jinja").read_text()
    line = json.dumps({"messages": REASONING})
    a = Tokenize(str(model_dir), 2048, "reject", turns="each", chat_template=template).tokenize_line("f:1", line)
    b = Tokenize(str(model_dir), 2048, "reject", turns="each", chat_template=template).tokenize_line("g:7", line)
    assert [r["sample_id"] for r in a] == [r["sample_id"] for r in b]
    assert [r["sample_id"].rsplit("#", 1)[1] for r in a] == ["0", "1"]
    assert [r["input_ids"] for r in a] == [r["input_ids"] for r in b]


def test_stage_maps_one_line_to_several_rows(model_dir):
    import pyarrow as pa

    from pipeline.intake.tokenize import TOKENIZED_SCHEMA

    t = Tokenize(str(model_dir), 2048, "reject", turns="auto", chat_template=(TEMPLATES / "qwen3.jinja").read_text())
    lines = [json.dumps({"id": "r", "messages": REASONING}), json.dumps({"id": "t", "text": "plain text"})]
    out = t(pa.table({"source": ["f:1", "f:2"], "line": lines}))
    assert out.schema == TOKENIZED_SCHEMA
    assert out["sample_id"].to_pylist() == ["r#0", "r#1", "t"]
    assert out["source"].to_pylist() == ["f:1", "f:1", "f:2"]
    assert out["turns"].to_pylist() == ["each", "each", ""]
    assert out["status"].to_pylist() == ["ok"] * 3


def test_default_template_reports_what_it_leaves_out(model_dir):
    [row] = Tokenize(str(model_dir), 2048, "reject").tokenize_line(
        "f:1", json.dumps({"messages": AGENT, "tools": TOOLS})
    )
    # SmolLM2's template cannot render a null content: the template's own error, nothing dropped.
    assert row["status"] == "error" and "NoneType" in row["reason"]
    agent = [dict(m, content=m["content"] or "Let me check.") for m in AGENT]
    [row] = Tokenize(str(model_dir), 2048, "reject").tokenize_line(
        "f:1", json.dumps({"messages": agent, "tools": TOOLS})
    )
    assert row["status"] == "ok" and row["turns"] == "full"
    assert row["unrendered"].split(",") == [
        "messages[1].reasoning_content",
        "messages[1].tool_calls",
        "messages[3].reasoning_content",
        "tools",
    ]


FINAL_ONLY_TAGS = (  # marks only the final assistant turn, and closes its block after the newline
    "{%- for m in messages %}<|im_start|>{{ m.role + '\\n' }}"
    "{%- if m.role == 'assistant' and loop.last %}{% generation %}{{ m.content }}<|im_end|>\n{% endgeneration %}"
    "{%- else %}{{ m.content }}<|im_end|>\n{% endif %}{% endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
# The generation prompt and the rendered history disagree on blank lines around the header.
LOOSE_WHITESPACE = (
    "{%- for m in messages %}{% if m.role == 'user' %}### Instruction:\n{{ m.content }}\n\n"
    "{%- else %}\n### Response:\n{{ m.content }}<|im_end|>\n\n{% endif %}{% endfor %}"
    "{%- if add_generation_prompt %}### Response:\n{% endif %}"
)


def test_generation_blocks_that_skip_turns_do_not_hide_them(model_dir):
    ct = ChatTokenizer(model_dir, chat_template=FINAL_ONLY_TAGS)
    msgs = [
        {"role": "user", "content": "q1"},
        {"role": "assistant", "content": "a1"},
        {"role": "user", "content": "q2"},
        {"role": "assistant", "content": "a2"},
    ]
    s = parse_line(json.dumps({"messages": msgs}))
    assert spans_of(ct, ct.encode_chat(s, "full")) == [["a1<|im_end|>", "a2<|im_end|>"]]
    # Where the blocks do cover the turn they give the mask, without the newline after the end token.
    assert spans_of(ct, ct.encode_chat(s, "each")) == [["a1<|im_end|>"], ["a2<|im_end|>"]]


def test_header_rendered_with_other_whitespace_is_not_trained_on(model_dir):
    ct = ChatTokenizer(model_dir, chat_template=LOOSE_WHITESPACE)
    msgs = [
        {"role": "user", "content": "Capital of Italy?"},
        {"role": "assistant", "content": "Rome."},
        {"role": "user", "content": "And Spain?"},
        {"role": "assistant", "content": "Madrid."},
    ]
    s = parse_line(json.dumps({"messages": msgs}))
    for policy in ("full", "each", "auto"):
        assert [sp for spans in spans_of(ct, ct.encode_chat(s, policy)) for sp in spans] == [
            "Rome.<|im_end|>",
            "Madrid.<|im_end|>",
        ]


class WithoutOffsets:
    """The default tokenizer as a slow one: no offset mapping."""

    is_fast = False

    def __init__(self, tok):
        self.tok = tok

    def __call__(self, text, **kw):
        assert "return_offsets_mapping" not in kw
        return self.tok(text, **kw)

    def decode(self, ids, **kw):
        return self.tok.decode(ids, **kw)


def test_offsets_without_a_fast_tokenizer_give_the_same_masks(model_dir):
    fast = ChatTokenizer(model_dir, chat_template=(TEMPLATES / "qwen3.jinja").read_text())
    slow = ChatTokenizer(model_dir, chat_template=(TEMPLATES / "qwen3.jinja").read_text())
    slow.chat.tok = WithoutOffsets(slow.tok)
    for conv in ("reasoning", "plain", "agent"):
        a, b = fast.encode_chat(sample(conv), "auto"), slow.encode_chat(sample(conv), "auto")
        assert [(s.encoded.ids, s.encoded.mask) for s in a.samples] == [
            (s.encoded.ids, s.encoded.mask) for s in b.samples
        ]

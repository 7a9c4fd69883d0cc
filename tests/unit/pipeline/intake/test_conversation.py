"""Regeneration's view of a conversation: which turns are rewritten, each turn's prompt, the row written back."""

import json

import pyarrow as pa
import pytest

from pipeline.intake.conversation import (
    RegenerationCodec,
    identify_lines,
    parse_conversation,
    regeneration_targets,
    split_reasoning,
)

MSGS = [
    {"role": "system", "content": "be brief"},
    {"role": "user", "content": "a?"},
    {"role": "assistant", "content": "old 1"},
    {"role": "user", "content": "b?"},
    {"role": "assistant", "content": None, "tool_calls": [{"type": "function", "function": {"name": "f"}}]},
    {"role": "tool", "content": "42"},
    {"role": "assistant", "content": "old 2", "weight": 1},
]


def test_targets_under_each_policy_and_tool_turns():
    assert regeneration_targets(MSGS, "last", False) == [6]
    assert regeneration_targets(MSGS, "each", False) == [2, 6]
    assert regeneration_targets(MSGS, "each", True) == [2, 4, 6]
    # A final tool-call turn is answered by what follows it: nothing to regenerate under `last`.
    assert regeneration_targets(MSGS[:5], "last", False) == []
    with pytest.raises(ValueError):
        regeneration_targets(MSGS, "all", False)


def test_prompts_show_regenerated_turns_and_rows_keep_their_schema():
    conv = parse_conversation(json.dumps({"id": 7, "messages": MSGS, "extra": "kept"}), "id", "each", False)
    assert conv.sample_id == "7" and conv.next_target() == 2
    conv.new[2] = _turn("new 1")
    prompt = conv.prompt_messages(6)
    assert [m["content"] for m in prompt[:4]] == ["be brief", "a?", "new 1", "b?"]
    assert prompt[4]["tool_calls"]  # left as written
    conv.new[6] = _turn("new 2")
    assert conv.next_target() is None
    row = conv.output_row("id")
    assert row["extra"] == "kept" and row["id"] == 7
    assert [m.get("content") for m in row["messages"]] == ["be brief", "a?", "new 1", "b?", None, "42", "new 2"]
    assert row["messages"][6]["weight"] == 1  # fields other than the text stay


def test_sharegpt_rows_come_back_as_sharegpt_with_an_id():
    line = json.dumps({"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "old"}]})
    conv = parse_conversation(line, "id", "last", False)
    conv.new[1] = _turn("new")
    row = conv.output_row("id")
    assert row["conversations"][1] == {"from": "gpt", "value": "new"}
    assert row["id"] == conv.sample_id  # the content id it had before its text changed


def test_reasoning_is_split_off_where_the_template_reads_it():
    assert split_reasoning("<think>\nhmm\n</think>\n\nyes") == ("hmm", "yes")
    assert split_reasoning("hmm</think>yes") == ("hmm", "yes")  # the opening tag was in the prompt
    assert split_reasoning("plain") == (None, "plain")
    msgs = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a", "thinking": "t"}]
    conv = parse_conversation(json.dumps({"messages": msgs}), "id", "last", False, reads_reasoning=True)
    conv.new[1] = _turn("<think>why</think>because")
    m = conv.output_row("id")["messages"][1]
    assert m["content"] == "because" and m["thinking"] == "why"  # the input's own name for it


def test_prompt_ids_are_the_templates_generation_prompt(model_dir):
    from transformers import AutoTokenizer

    codec = RegenerationCodec(str(model_dir), {}, "id", "each", False)
    conv = codec.parse(json.dumps({"messages": MSGS[:4] + [{"role": "assistant", "content": "x"}]}))
    codec.accept(conv, 2, "NEW ONE", "stop", 10, [1, 2])
    ids = codec.prompt_ids(conv, 4)
    tok = AutoTokenizer.from_pretrained(model_dir)
    text = tok.decode(ids)
    assert "NEW ONE" in text and "old 1" not in text
    assert text.endswith(tok.apply_chat_template([{"role": "user", "content": "b?"}], tokenize=False,
                                                 add_generation_prompt=True).split("b?")[-1])  # fmt: skip


def test_identify_lines_gives_ids_and_error_rows_without_a_tokenizer():
    lines = [
        json.dumps({"id": "a", "messages": MSGS}),
        json.dumps({"text": "not a chat"}),
        "{broken",
        "",
    ]
    batch = pa.table(
        {
            "source": [f"f:{i}" for i in range(4)],
            "line": lines,
            "read_error": ["", "", "", "not valid UTF-8"],
            "read_id": ["", "", "", "hbad"],
        }
    )
    out = identify_lines(batch).to_pylist()
    assert [(r["sample_id"], r["status"], r["stage"]) for r in out] == [
        ("a", "ok", ""),
        (out[1]["sample_id"], "error", "parse"),
        (out[2]["sample_id"], "error", "parse"),
        ("hbad", "error", "read"),
    ]
    assert out[0]["line"] == lines[0] and "conversation" in out[1]["reason"]


def _turn(text):
    from pipeline.intake.conversation import NewTurn

    return NewTurn(text, "stop", 1)

import json

import pytest

from pipeline.intake.normalize import BadRow, content_id, parse_line, row_id_fallback

CHAT = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]


def line(obj) -> str:
    return json.dumps(obj)


def test_messages_row():
    s = parse_line(line({"id": "a1", "messages": CHAT}))
    assert (s.sample_id, s.kind) == ("a1", "chat")
    assert s.messages == tuple(CHAT)


def test_messages_keep_every_field_a_template_may_read():
    msgs = [
        {"role": "user", "content": "weather?", "name": "ann"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [{"type": "function", "function": {"name": "w", "arguments": "{}"}}],
        },
        {"role": "tool", "content": "22 C", "tool_call_id": "c1", "name": "w"},
        {"role": "function", "content": "ok", "name": "w"},
        {"role": "assistant", "content": "Warm.", "weight": 1},
    ]
    assert parse_line(line({"messages": msgs})).messages == tuple(msgs)


@pytest.mark.parametrize("alias", ["reasoning_content", "reasoning", "thinking"])
def test_reasoning_aliases_fold_into_reasoning_content(alias):
    s = parse_line(
        line({"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a", alias: "hmm"}]})
    )
    assert s.messages[1] == {"role": "assistant", "content": "a", "reasoning_content": "hmm"}


def test_same_reasoning_under_two_aliases_is_one_field():
    m = {"role": "assistant", "content": "a", "reasoning": "r", "reasoning_content": "r"}
    assert parse_line(line({"messages": [m]})).messages[0] == {
        "role": "assistant",
        "content": "a",
        "reasoning_content": "r",
    }


def test_row_tools_list_or_json_string():
    tools = [{"type": "function", "function": {"name": "w", "parameters": {}}}]
    assert parse_line(line({"messages": CHAT, "tools": tools})).tools == tuple(tools)
    assert parse_line(line({"messages": CHAT, "tools": json.dumps(tools)})).tools == tuple(tools)
    assert parse_line(line({"messages": CHAT, "tools": []})).tools is None


def test_tools_change_the_derived_id_and_plain_rows_keep_theirs():
    plain = parse_line(line({"messages": CHAT})).sample_id
    assert plain == content_id({"messages": CHAT})
    assert parse_line(line({"messages": CHAT, "tools": [{"name": "w"}]})).sample_id != plain


def test_sharegpt_tool_speakers_and_extra_fields():
    convs = [
        {"from": "human", "value": "q"},
        {"from": "gpt", "value": "a", "reasoning": "r"},
        {"from": "observation", "value": "o"},
        {"from": "gpt", "value": "b"},
    ]
    s = parse_line(line({"conversations": convs}))
    assert [m["role"] for m in s.messages] == ["user", "assistant", "tool", "assistant"]
    assert s.messages[1] == {"role": "assistant", "content": "a", "reasoning_content": "r"}


def test_sharegpt_row_maps_speakers():
    convs = [
        {"from": "system", "value": "be brief"},
        {"from": "human", "value": "q"},
        {"from": "gpt", "value": "a"},
    ]
    s = parse_line(line({"conversations": convs}))
    assert s.kind == "chat"
    assert [m["role"] for m in s.messages] == ["system", "user", "assistant"]
    assert [m["content"] for m in s.messages] == ["be brief", "q", "a"]


def test_input_ids_with_and_without_loss_mask():
    s = parse_line(line({"input_ids": [5, 6, 7], "loss_mask": [0, 1, 1]}))
    assert (s.kind, s.input_ids, s.loss_mask) == ("tokens", (5, 6, 7), (0, 1, 1))
    s = parse_line(line({"input_ids": [5, 6, 7]}))
    assert s.loss_mask is None
    s = parse_line(line({"input_ids": [5, 6, 7], "loss_mask": None}))
    assert s.loss_mask is None


def test_text_row():
    s = parse_line(line({"text": "plain text"}))
    assert (s.kind, s.text) == ("text", "plain text")


def test_custom_id_field_and_integer_ids_become_strings():
    s = parse_line(line({"uid": 42, "id": "ignored", "text": "t"}), id_field="uid")
    assert s.sample_id == "42"
    assert parse_line(line({"id": 7, "messages": CHAT})).sample_id == "7"


@pytest.mark.parametrize(
    "row, changed",
    [
        ({"messages": CHAT}, {"messages": [CHAT[0], {"role": "assistant", "content": "hellO"}]}),
        (
            {"conversations": [{"from": "human", "value": "q"}, {"from": "gpt", "value": "a"}]},
            {"conversations": [{"from": "human", "value": "q"}, {"from": "gpt", "value": "b"}]},
        ),
        ({"input_ids": [1, 2, 3]}, {"input_ids": [1, 2, 4]}),
        ({"input_ids": [1, 2, 3], "loss_mask": [0, 1, 1]}, {"input_ids": [1, 2, 3], "loss_mask": [1, 1, 1]}),
        ({"text": "some text"}, {"text": "some text "}),
    ],
)
def test_derived_id_is_stable_and_content_sensitive(row, changed):
    first = parse_line(line(row)).sample_id
    assert first.startswith("h") and len(first) == 25
    # Same content with other key order and whitespace -> same id.
    assert parse_line(json.dumps(row, indent=1, sort_keys=True).replace("\n", " ")).sample_id == first
    assert parse_line(line(changed)).sample_id != first


def test_loss_mask_changes_derived_id():
    a = parse_line(line({"input_ids": [1, 2], "loss_mask": [1, 1]})).sample_id
    b = parse_line(line({"input_ids": [1, 2], "loss_mask": [0, 1]})).sample_id
    c = parse_line(line({"input_ids": [1, 2]})).sample_id
    assert len({a, b, c}) == 3


def test_content_id_is_key_order_independent():
    assert content_id({"a": 1, "b": [1, 2]}) == content_id({"b": [1, 2], "a": 1})
    assert content_id({"a": 1}) != content_id({"a": 2})


@pytest.mark.parametrize(
    "raw, reason",
    [
        ('{"messages": [', "not valid JSON"),
        ("[1, 2]", "must be a JSON object"),
        ('"just a string"', "must be a JSON object"),
        (line({"messages": []}), "non-empty list of messages"),
        (line({"messages": "hello"}), "non-empty list of messages"),
        (line({"messages": ["hello"]}), r"messages\[0\] is not an object"),
        (line({"messages": [{"role": "robot", "content": "x"}]}), r"messages\[0\]: unknown role 'robot'"),
        (line({"conversations": [{"from": "bot", "value": "x"}]}), r"conversations\[0\]: unknown speaker 'bot'"),
        (line({"messages": [{"role": "assistant", "content": 3}]}), r"messages\[0\]: content must be a string"),
        (line({"messages": [{"role": "assistant"}]}), r"messages\[0\]: content must be a string"),
        (line({"messages": [{"role": "user", "content": "q"}]}), "no assistant turn"),
        (line({"input_ids": [1, 2], "loss_mask": [1]}), "loss_mask has 1 entries for 2 input_ids"),
        (line({"input_ids": [1, 2], "loss_mask": [1, 2]}), "must be 0 or 1"),
        (line({"input_ids": [1, 2], "loss_mask": [True, False]}), "loss_mask` must be a non-empty list of integers"),
        (line({"input_ids": []}), "input_ids` must be a non-empty list of integers"),
        (line({"input_ids": [1, "2"]}), "input_ids` must be a non-empty list of integers"),
        (line({"text": ""}), "text` must be a non-empty string"),
        (line({"id": 1.5, "text": "t"}), "`id` must be a string or an integer"),
        (
            line({"prompt": "p", "completion": "c"}),
            r"none of messages, conversations, input_ids, text \(keys: \['completion', 'prompt'\]\)",
        ),
        (line({"messages": [{"role": "user", "content": None}]}), r"messages\[0\]: content must be a string"),
        (line({"messages": [{"role": "assistant", "content": None}]}), r"messages\[0\]: content must be a string"),
        (
            line({"messages": [{"role": "assistant", "content": "a", "reasoning": "x", "thinking": "y"}]}),
            "different reasoning texts",
        ),
        (line({"messages": [{"role": "assistant", "content": "a", "reasoning_content": 3}]}), "must be a string"),
        (
            line({"messages": [{"role": "assistant", "content": "a", "tool_calls": {"name": "f"}}]}),
            "tool_calls must be a list of objects",
        ),
        (
            line({"messages": [{"role": "user", "content": "a", "tool_calls": [{"name": "f"}]}]}),
            "only assistant messages carry tool_calls",
        ),
        (line({"messages": CHAT, "tools": "not json"}), "not a JSON list of tools"),
        (line({"messages": CHAT, "tools": {"name": "f"}}), "`tools` must be a list of tool objects"),
    ],
)
def test_bad_rows_say_why(raw, reason):
    with pytest.raises(BadRow, match=reason):
        parse_line(raw)


def test_row_id_fallback_uses_id_field_when_present():
    assert row_id_fallback(line({"id": 9, "messages": []})) == "9"
    assert row_id_fallback(line({"key": "k", "messages": []}), id_field="key") == "k"


def test_row_id_fallback_is_stable_per_content():
    a = row_id_fallback('{"messages": [')
    assert a == row_id_fallback('{"messages": [')
    assert a != row_id_fallback('{"messages": [[')
    assert a.startswith("h") and len(a) == 25
    assert row_id_fallback("[1]") != row_id_fallback("[2]")

import json

import pyarrow as pa
import pytest

from pipeline.intake.normalize import parse_line
from pipeline.intake.tokenize import TOKENIZED_SCHEMA, Tokenize


@pytest.fixture(scope="module")
def tokenize(model_dir):
    return Tokenize(str(model_dir), max_tokens=2048, overlength="reject")


def encode(chat_tokenizer, messages):
    return chat_tokenizer.encode(parse_line(json.dumps({"messages": messages})))


def masked_spans(tok, ids, mask) -> list[str]:
    """Decoded runs of consecutive mask-1 tokens."""
    spans, cur = [], []
    for i, m in zip(ids, mask):
        if m:
            cur.append(i)
        elif cur:
            spans.append(tok.decode(cur))
            cur = []
    if cur:
        spans.append(tok.decode(cur))
    return spans


def retokenized_template(tok, messages) -> list[int]:
    text = tok.apply_chat_template(messages, tokenize=False)
    return tok(text, add_special_tokens=False)["input_ids"]


def u(text):
    return {"role": "user", "content": text}


def a(text):
    return {"role": "assistant", "content": text}


@pytest.mark.parametrize(
    "messages",
    [
        [u("question one"), a("answer one"), u("question two"), a("answer two")],
        [{"role": "system", "content": "Be terse."}, u("q"), a("short")],
        [u("q"), a("first"), a("second")],
        [u("日本語で 🙂?"), a("émoji 🚀👍🏽 中文 ok")],
        [u("q"), a("a"), u("a trailing user turn gets no mask")],
        [u("q"), a("multi\nline\n\nanswer")],
    ],
    ids=["two-turn", "system", "consecutive-assistant", "unicode", "trailing-user", "newlines"],
)
def test_mask_covers_exactly_assistant_content_and_end_of_turn(chat_tokenizer, messages):
    ids, mask = encode(chat_tokenizer, messages)
    tok = chat_tokenizer.tok
    assert ids == retokenized_template(tok, messages)
    assert len(mask) == len(ids) and set(mask) <= {0, 1}
    expected = [m["content"] + "<|im_end|>" for m in messages if m["role"] == "assistant"]
    assert masked_spans(tok, ids, mask) == expected
    # Every masked run ends on the end-of-turn token; the newline after it is not trained on.
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    for j in range(len(ids) - 1):
        if mask[j] and not mask[j + 1]:
            assert ids[j] == im_end
    assert tok.decode(ids[-1:]) == "\n" and mask[-1] == 0


def test_two_turn_masked_ids_decode_to_answers(chat_tokenizer):
    ids, mask = encode(chat_tokenizer, [u("question one"), a("answer one"), u("question two"), a("answer two")])
    masked = [i for i, m in zip(ids, mask) if m]
    assert chat_tokenizer.tok.decode(masked) == "answer one<|im_end|>answer two<|im_end|>"


def test_header_system_and_user_tokens_are_unmasked(chat_tokenizer):
    messages = [{"role": "system", "content": "SYS"}, u("USER"), a("ANSWER")]
    ids, mask = encode(chat_tokenizer, messages)
    unmasked = chat_tokenizer.tok.decode([i for i, m in zip(ids, mask) if not m])
    assert unmasked == "<|im_start|>system\nSYS<|im_end|>\n<|im_start|>user\nUSER<|im_end|>\n<|im_start|>assistant\n\n"


def test_assistant_first_conversation_masks_only_the_answer(chat_tokenizer):
    ids, mask = encode(chat_tokenizer, [a("hi there"), u("thanks")])
    assert masked_spans(chat_tokenizer.tok, ids, mask) == ["hi there<|im_end|>"]


def test_content_merging_with_header_is_masked_whole(chat_tokenizer, tokenize):
    # "\n\n" at the start of the answer merges with the header's "\n" into one token; the model
    # generates that token, so it is masked whole rather than dropped.
    [row] = tokenize.tokenize_line("f:1", json.dumps({"messages": [u("q"), a("\n\nlead")]}))
    assert row["status"] == "ok", row["reason"]
    assert masked_spans(chat_tokenizer.tok, row["input_ids"], row["loss_mask"]) == ["\n\n\nlead<|im_end|>"]


def test_text_row_masks_everything(chat_tokenizer):
    ids, mask = chat_tokenizer.encode(parse_line(json.dumps({"text": "hello world, plain text"})))
    assert chat_tokenizer.tok.decode(ids) == "hello world, plain text"
    assert mask == [1] * len(ids)


def test_pretokenized_rows_pass_through(chat_tokenizer):
    ids, mask = chat_tokenizer.encode(parse_line(json.dumps({"input_ids": [1, 2, 3], "loss_mask": [0, 0, 1]})))
    assert (ids, mask) == ([1, 2, 3], [0, 0, 1])
    ids, mask = chat_tokenizer.encode(parse_line(json.dumps({"input_ids": [7, 8]})))
    assert (ids, mask) == ([7, 8], [1, 1])


@pytest.mark.parametrize("bad_id", [49152, -1, 10**9])
def test_out_of_vocab_id_is_error_row(tokenize, bad_id):
    [row] = tokenize.tokenize_line("f.jsonl:3", json.dumps({"id": "x", "input_ids": [1, bad_id]}))
    assert (row["sample_id"], row["status"], row["stage"]) == ("x", "error", "tokenize")
    assert "outside the vocabulary [0, 49152)" in row["reason"] and str(bad_id) in row["reason"]
    assert row["input_ids"] == [] and row["num_tokens"] == 0


def test_parse_error_becomes_error_row_with_fallback_id(tokenize):
    [row] = tokenize.tokenize_line("f.jsonl:9", '{"id": "k", "messages": []}')
    assert (row["sample_id"], row["source"], row["status"], row["stage"]) == ("k", "f.jsonl:9", "error", "parse")
    assert "non-empty list" in row["reason"]


def test_all_zero_mask_is_filtered(tokenize):
    [row] = tokenize.tokenize_line("s", json.dumps({"input_ids": [1, 2], "loss_mask": [0, 0]}))
    assert (row["status"], row["reason"]) == ("filtered", "no token has loss_mask 1")


def test_overlength_reject_and_truncate(model_dir):
    line = json.dumps({"id": "long", "input_ids": list(range(10, 30)), "loss_mask": [0] * 5 + [1] * 15})
    [rejected] = Tokenize(str(model_dir), max_tokens=8, overlength="reject").tokenize_line("s", line)
    assert (rejected["status"], rejected["stage"]) == ("filtered", "tokenize")
    assert rejected["reason"] == "20 tokens > extract.max_tokens=8 (overlength=reject)"
    [truncated] = Tokenize(str(model_dir), max_tokens=8, overlength="truncate").tokenize_line("s", line)
    assert truncated["status"] == "ok"
    assert truncated["num_tokens"] == 8 == len(truncated["input_ids"]) == len(truncated["loss_mask"])
    assert truncated["input_ids"] == list(range(10, 18))
    assert truncated["loss_mask"] == [0] * 5 + [1] * 3


def test_call_returns_tokenized_schema(tokenize):
    lines = [
        json.dumps({"id": "c", "messages": [u("q"), a("a")]}),
        "not json",
        json.dumps({"text": "some text"}),
    ]
    out = tokenize(pa.table({"source": ["f:1", "f:2", "f:3"], "line": lines}))
    assert out.schema == TOKENIZED_SCHEMA
    assert out["status"].to_pylist() == ["ok", "error", "ok"]
    assert out["source"].to_pylist() == ["f:1", "f:2", "f:3"]
    assert out["sample_id"][0].as_py() == "c"
    assert out["num_tokens"].to_pylist() == [len(x) for x in out["input_ids"].to_pylist()]


def test_call_names_missing_columns(tokenize):
    with pytest.raises(KeyError, match=r"\['line'\]"):
        tokenize(pa.table({"source": ["f:1"], "text": ["x"]}))
    with pytest.raises(KeyError, match=r"\['source', 'line'\]"):
        tokenize(pa.table({"other": [1]}))


def test_rows_of_token_ids_never_load_the_tokenizer_when_its_size_is_known(model_dir):
    """The driver passes the tokenizer's size: a stage that only sees token-id rows skips the seconds-long load."""
    from pipeline.intake.tokenize import tokenizer_facts

    hashes, size = tokenizer_facts(model_dir)
    assert set(hashes) == {"tokenizer_sha256", "chat_template_sha256"} and size > 1000
    stage = Tokenize(str(model_dir), max_tokens=2048, overlength="reject", vocab_size=size)
    [ok] = stage.tokenize_line("f:1", json.dumps({"id": "a", "input_ids": [1, size - 1]}))
    [bad] = stage.tokenize_line("f:2", json.dumps({"id": "b", "input_ids": [1, size]}))
    assert ok["status"] == "ok" and bad["status"] == "error" and f"[0, {size})" in bad["reason"]
    assert stage.tokenizer._tok is None  # never loaded
    # A chat row still renders through the template, which loads the tokenizer then.
    [chat] = stage.tokenize_line("f:3", json.dumps({"messages": [u("hi"), {"role": "assistant", "content": "yo"}]}))
    assert chat["status"] == "ok" and stage.tokenizer._tok is not None and stage.tokenizer.vocab_size == size

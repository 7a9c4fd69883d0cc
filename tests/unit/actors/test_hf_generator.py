"""The transformers generator regeneration falls back on: greedy answers, finish reasons, seeded sampling."""

import pytest

from actors.hf.generator import HFGenerator


@pytest.fixture(scope="module")
def generator(model_dir):
    with HFGenerator(str(model_dir), cpu_threads=2) as g:
        yield g


def _prompt(model_dir, question):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    msgs = [{"role": "user", "content": question}]
    return tok(tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True), add_special_tokens=False)[
        "input_ids"
    ]


def test_greedy_answer_stops_and_a_short_budget_truncates(generator, model_dir):
    ids = _prompt(model_dir, "What is the capital of France?")
    greedy = {"temperature": 0.0, "top_p": 1.0, "max_new_tokens": 32, "seed": 1}
    res = generator.submit_generate("a", ids, greedy).result(timeout=120)
    assert res.error is None and "Paris" in res.text and res.finish_reason == "stop"
    short = generator.submit_generate("b", ids, dict(greedy, max_new_tokens=3)).result(timeout=120)
    assert short.finish_reason == "length" and len(short.output_ids) == 3
    assert short.output_ids == res.output_ids[:3]


def test_a_seed_decides_the_sample(generator, model_dir):
    ids = _prompt(model_dir, "Write a word.")
    params = {"temperature": 1.0, "top_p": 0.95, "max_new_tokens": 8}
    a, b, c = (generator.submit_generate(k, ids, dict(params, seed=s)) for k, s in (("a", 5), ("b", 5), ("c", 6)))
    a, b, c = (f.result(timeout=120) for f in (a, b, c))
    assert a.output_ids == b.output_ids
    assert a.output_ids != c.output_ids

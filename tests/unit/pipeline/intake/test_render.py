import pytest

from pipeline.intake.normalize import BadRow
from pipeline.intake.render import TemplateRenderer, reasoning_keys


@pytest.mark.parametrize(
    "template, keys",
    [
        ("{{ message.reasoning_content }}", ("reasoning_content",)),
        ("{% if message.thinking %}{{ message.thinking }}{% endif %}", ("thinking",)),
        ("{{ m['reasoning'] }}", ("reasoning",)),
        ("{% if 'thinking' in m %}x{% endif %}", ("thinking",)),
        # enable_thinking is a switch, not the field; a template that reads no alias gets the canonical key.
        ("{% if enable_thinking %}<think>{% endif %}{{ m.content }}", ("reasoning_content",)),
    ],
)
def test_reasoning_goes_under_the_key_the_template_reads(template, keys):
    assert reasoning_keys(template) == keys


class Tok:
    def __init__(self, template):
        self.chat_template = template
        self.calls = []

    def apply_chat_template(self, msgs, **kw):
        self.calls.append((msgs, kw))
        if "boom" in str(msgs):
            raise ValueError("the template says no")
        return "rendered"


def test_renderer_passes_tools_kwargs_and_the_reasoning_alias():
    tok = Tok("{{ m.thinking }}")
    r = TemplateRenderer(tok, {"enable_thinking": False})
    msgs = [{"role": "assistant", "content": "a", "reasoning_content": "r"}]
    assert r.render(msgs, tools=({"name": "f"},), generation_prompt=True) == "rendered"
    sent, kw = tok.calls[0]
    assert sent == [{"role": "assistant", "content": "a", "thinking": "r"}]
    assert kw == {"tools": [{"name": "f"}], "tokenize": False, "add_generation_prompt": True, "enable_thinking": False}


def test_template_errors_become_bad_rows_with_its_message():
    r = TemplateRenderer(Tok("x"))
    with pytest.raises(BadRow, match="chat template cannot render this conversation: ValueError: the template says no"):
        r.render([{"role": "user", "content": "boom"}])
    with pytest.raises(BadRow, match="no chat_template"):
        TemplateRenderer(Tok(None)).render([{"role": "user", "content": "x"}])

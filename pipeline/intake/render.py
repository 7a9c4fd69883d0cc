"""The target's chat template as a function: messages -> rendered text, or a BadRow with the template's message.

Everything here is the template's own behaviour; nothing is reformatted. Two adaptations only:
- the reasoning text is handed over under the key(s) the template reads (`reasoning_content` for
  Qwen3/Kimi/DeepSeek/GLM, `thinking` for gpt-oss, `reasoning` for some others);
- a row-level tool list goes in as `tools=`, and `extract.template_kwargs` (e.g. `enable_thinking`)
  as extra template variables.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

from pipeline.intake.normalize import REASONING_ALIASES, REASONING_KEY, BadRow

_GENERATION_TAG = re.compile(r"\{%-?\s*generation\s*-?%\}")


def reasoning_keys(template: str) -> tuple[str, ...]:
    """The reasoning aliases a template reads (as an attribute, an item or an `in` test)."""
    found = tuple(k for k in REASONING_ALIASES if re.search(rf"""(\.|\[\s*['"]|['"]){k}\b""", template))
    return found or (REASONING_KEY,)


class TemplateRenderer:
    """Renders conversations with one tokenizer's chat template and fixed extra kwargs."""

    def __init__(self, tok, template_kwargs: dict | None = None):
        self.tok = tok
        self.kwargs = dict(template_kwargs or {})

    @property
    def template(self) -> str:
        # Read from the tokenizer each time: callers (tests, notebooks) may swap the template on it.
        if not self.tok.chat_template:
            raise BadRow("the tokenizer has no chat_template; chat rows need one (or give input_ids / text rows)")
        return self.tok.chat_template

    @property
    def has_generation_tags(self) -> bool:
        return bool(_GENERATION_TAG.search(self.template))

    def _adapt(self, m: dict) -> dict:
        keys = reasoning_keys(self.template)
        if REASONING_KEY not in m or keys == (REASONING_KEY,):
            return m
        out = {k: v for k, v in m.items() if k != REASONING_KEY}
        out.update({k: m[REASONING_KEY] for k in keys})
        return out

    def render(self, messages: Sequence[dict], tools=None, generation_prompt: bool = False) -> str:
        msgs = [self._adapt(m) for m in messages]
        try:
            return self.tok.apply_chat_template(
                msgs,
                tools=list(tools) if tools else None,
                tokenize=False,
                add_generation_prompt=generation_prompt,
                **self.kwargs,
            )
        except Exception as e:  # noqa: BLE001 -- the template is user code: its own message is the reason
            raise BadRow(f"chat template cannot render this conversation: {type(e).__name__}: {e}") from None

    def assistant_token_mask(self, messages: Sequence[dict], tools=None) -> tuple[list[int], list[int]]:
        """(input_ids, mask) from the template's `{% generation %}` blocks."""
        msgs = [self._adapt(m) for m in messages]
        try:
            out = self.tok.apply_chat_template(
                msgs,
                tools=list(tools) if tools else None,
                tokenize=True,
                return_dict=True,
                return_assistant_tokens_mask=True,
                **self.kwargs,
            )
        except Exception as e:  # noqa: BLE001 -- the template is user code: its own message is the reason
            raise BadRow(f"chat template cannot render this conversation: {type(e).__name__}: {e}") from None
        return list(out["input_ids"]), list(out["assistant_masks"])

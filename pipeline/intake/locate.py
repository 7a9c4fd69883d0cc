"""Locating an assistant turn in a rendered conversation, by character offsets.

A turn's text starts where the render leaves the prompt the model answered (the conversation before the
turn rendered with `add_generation_prompt=True`): what the model saw is not trained on, what it generated
is. It ends where the turn's rendered text ends. Where the template renders the history otherwise once
more messages follow (reasoning dropped from earlier turns, another end token), the turn is what
disappears from the render when it is left out. Every placement is checked against the neighbouring
messages' text: a mask never starts inside an earlier message nor runs into the next one.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

from pipeline.intake.normalize import REASONING_KEY, BadRow
from pipeline.intake.render import TemplateRenderer


def lcp(a: str, b: str) -> int:
    return len(os.path.commonprefix([a, b]))


def lcs(a: str, b: str) -> int:
    return len(os.path.commonprefix([a[::-1], b[::-1]]))


def texts(m: dict) -> list[str]:
    """The message's own text fields, as they would appear verbatim in most templates."""
    return [t.strip() for t in (m.get(REASONING_KEY), m.get("content")) if isinstance(t, str) and t.strip()]


def call_names(m: dict) -> list[str]:
    names = []
    for c in m.get("tool_calls") or ():
        fn = c.get("function") if isinstance(c.get("function"), dict) else c
        if isinstance(fn.get("name"), str):
            names.append(fn["name"])
    return names


def skip_rendered(text: str, a: int, rest: str) -> int:
    """Past `rest` (the end of the prompt the model saw) where `text` renders it from `a` with other whitespace
    (templates whose history and generation prompt differ in blank lines); `a` where it does not render it."""
    i = a
    for ch in rest:
        if ch.isspace():
            continue
        while i < len(text) and text[i].isspace():
            i += 1
        if i >= len(text) or text[i] != ch:
            return a
        i += 1
    trailing = len(rest) - len(rest.rstrip())  # the prompt's own closing whitespace was seen, not generated
    while trailing and i < len(text) and text[i].isspace():
        i, trailing = i + 1, trailing - 1
    return i


class TurnLocator:
    """Finds an assistant turn's characters in a rendered conversation, with the template as the only truth."""

    def __init__(self, renderer: TemplateRenderer):
        self.r = renderer
        self._headers: dict[str, str] = {}
        # Renders of prefixes of the conversation being encoded: both policies ask for the same prompts.
        self._conv: Sequence[dict] = ()
        self._memo: dict[tuple[int, bool], str] = {}

    def _render(self, msgs, tools, gen: bool = False) -> str:
        prefix = len(msgs) <= len(self._conv) and all(a is b for a, b in zip(msgs, self._conv))
        if not prefix:
            return self.r.render(msgs, tools, generation_prompt=gen)
        if (len(msgs), gen) not in self._memo:
            self._memo[(len(msgs), gen)] = self.r.render(msgs, tools, generation_prompt=gen)
        return self._memo[(len(msgs), gen)]

    def header(self) -> str:
        """The assistant header the generation prompt adds after a user message (e.g. `<|im_start|>assistant\\n`)."""
        template = self.r.template
        if template not in self._headers:
            u = [{"role": "user", "content": "x"}]
            try:
                h, g = self._render(u, None), self._render(u, None, gen=True)
                self._headers[template] = g[len(h) :] if g.startswith(h) else ""
            except BadRow:
                self._headers[template] = ""
        return self._headers[template]

    def turn_start(self, msgs: Sequence[dict], tools, text: str, i: int) -> int:
        """Character offset in `text` (a render of msgs) where assistant message i's generated text begins:
        where the text leaves the prompt the model answered (msgs[:i] with the generation prompt)."""
        if i > 0:
            pre = self._render(msgs[:i], tools, gen=True)
            a = lcp(text, pre)
            a = skip_rendered(text, a, pre[a:]) if a < len(pre) else a
        else:
            try:
                pre = self._render(msgs[:0], tools, gen=True)
            except BadRow:
                pre = None
            if pre is not None and text.startswith(pre):
                a = len(pre)
            else:  # nothing before it, and the template adds text of its own (a default system prompt, say)
                found = [text.find(t) for t in texts(msgs[0]) + call_names(msgs[0]) if text.find(t) >= 0]
                if not found:
                    raise BadRow("cannot locate the first assistant message in the rendered template")
                a = min(found)
                # What the template writes between the assistant header and the text is generated too.
                header = self.header()
                k = text.rfind(header, 0, a) if header else -1
                a = k + len(header) if k >= 0 else a
        self._check_start(msgs, text, i, a)
        return a

    @staticmethod
    def _check_start(msgs, text: str, i: int, a: int) -> None:
        prev = max((j for j in range(i) if msgs[j]["role"] == "assistant"), default=-1)
        for j in range(prev + 1, i):  # the messages just before the turn must be rendered before its start
            for t in texts(msgs[j]):
                pos = text.find(t)
                if pos >= 0 and pos + len(t) > a:
                    raise BadRow(f"assistant message {i} would start inside the rendered text of message {j}")

    def _cut(self, msgs, tools, text: str, i: int) -> tuple[int, int, int]:
        """(lo, hi, n): text == rest[:p] + text[p:p+n] + rest[p:] for every p in [lo, hi], where rest is the
        conversation rendered without message i; i.e. what disappears when the turn is left out."""
        rest = self._render(list(msgs[:i]) + list(msgs[i + 1 :]), tools)
        n = len(text) - len(rest)
        lo, hi = len(rest) - min(lcs(text, rest), len(rest)), min(lcp(text, rest), len(rest))
        if n <= 0 or lo > hi:
            raise BadRow(f"assistant message {i}: leaving it out changes how the template renders the others")
        return lo, hi, n

    def turn_end(self, msgs: Sequence[dict], tools, text: str, i: int, a: int) -> int:
        """Character offset in `text` where assistant message i's rendered text ends (before any trailing text)."""
        if i == len(msgs) - 1:
            return len(text)
        through = self._render(msgs[: i + 1], tools)
        if text.startswith(through) and len(through) > a:
            return len(through)
        # The template renders the turn differently when others follow (reasoning dropped from history,
        # another end token, ...): its text is what disappears when it is left out.
        lo, hi, n = self._cut(msgs, tools, text, i)
        # Ambiguous only where the turn's edges repeat its neighbours' (two turns both ending in
        # "<|im_end|>\n"): the turn is the cut that starts with the assistant header, else the latest one.
        header = self.header()
        best = max(range(lo, min(hi, a) + 1), key=lambda p: (lcp(text[p:a], header), p), default=None)
        if best is None or best + n <= a:
            raise BadRow(f"assistant message {i}: cannot place its rendered text in the conversation")
        return best + n

    def locate(self, msgs, tools, text: str, i: int) -> tuple[int, int]:
        try:
            a = self.turn_start(msgs, tools, text, i)
            b = self.turn_end(msgs, tools, text, i, a)
        except BadRow:
            # The prompt for this turn renders the history otherwise than the whole conversation does (Qwen3
            # keeps a tool call's reasoning only while no user message follows): take the final turn after its
            # header, cut any other turn out, and start it after the assistant header.
            final = self._final_start(msgs, tools, text, i)
            if final is not None:
                a, b = final, len(text)
            else:
                lo, hi, n = self._cut(msgs, tools, text, i)
                header = self.header()
                p = max(range(lo, hi + 1), key=lambda q: (lcp(text[q : q + n], header), q))
                a, b = p + lcp(text[p : p + n], header), p + n
            self._check_start(msgs, text, i, a)
        nxt = next((m for m in msgs[i + 1 :] if m["role"] != "assistant"), None)
        for t in texts(nxt) if nxt else ():  # the message after the turn must not be under its mask
            if text.find(t, a) >= 0 and text.find(t, b) < 0:
                raise BadRow(f"assistant message {i}: its located text runs into the next message")
        return a, b

    def _final_start(self, msgs, tools, text: str, i: int) -> int | None:
        """Where the final message i's own text starts in `text`: after the assistant header, where the render
        parts from that of an empty final turn (the history before it is the same in both). None if unclear."""
        header = self.header()
        if i != len(msgs) - 1 or not header:
            return None
        try:
            empty = self._render(list(msgs[:i]) + [{"role": "assistant", "content": ""}], tools)
        except BadRow:
            return None
        cut = text.rfind(header, 0, lcp(text, empty) + 1)
        return None if cut < 0 else cut + len(header)

    def _as_seen(self, head, tools, text: str, i: int) -> tuple[str, int] | None:
        """(prompt + turn, turn start) where the template renders the history before the final turn otherwise
        than the prompt the model answered (gpt-oss keeps the reasoning of tool calls only until a final answer
        follows): the model saw the generation prompt and produced the turn, so that is the sample.
        None where the render already starts with the prompt, or where the turn cannot be cut out safely."""
        if i == 0:
            return None
        pre = self._render(head[:i], tools, gen=True)
        if text.startswith(pre) or not pre.endswith(self.header()):
            return None
        start = self._final_start(head, tools, text, i)
        if start is None or lcp(text, pre) > start - len(self.header()):  # the history agrees: no splice needed
            return None
        return pre + text[start:], len(pre)

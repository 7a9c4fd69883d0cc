"""What a run that failed mid-way tells its user: one line naming the root cause and what to do next."""

from __future__ import annotations

import errno
import re

from pipeline.format.storage import redact

_ANSI = re.compile(r"\x1b\[[0-9;]*m")
_FRAME = re.compile(r'^\s*File "([^"]*)", line (\d+)', re.M)  # a frame of a Python traceback: file, line
# The last line of a Python traceback: `pkg.module.SomeError: message` (or the bare name).
_EXCEPTION_LINE = re.compile(r"^([A-Za-z_][\w.]*(?:Error|Exception|Exit|Interrupt|Failure))(?::\s*(.*))?$")


def _is_marker(e: BaseException) -> bool:
    """Ray Data re-raises an error `from SystemException()`: an empty marker that says nothing of the cause."""
    return type(e).__name__ == "SystemException" and type(e).__module__.startswith("ray.") and not str(e).strip()


def root_cause(e: BaseException) -> BaseException:
    """The innermost exception: through `raise ... from`, implicit context, and Ray's task errors (`.cause`)."""
    seen: set[int] = set()
    while id(e) not in seen:
        seen.add(id(e))
        cause = getattr(e, "cause", None)
        # `raise ... from None` says the context is not the cause (Python's own traceback hides it too).
        context = None if e.__suppress_context__ else e.__context__
        nxt = cause if isinstance(cause, BaseException) else (e.__cause__ or context)
        if nxt is None or _is_marker(nxt):
            break
        e = nxt
    return e


def _where(lines: list[str]) -> str:
    """`at pkg/file.py:N: <source line>` of a traceback's last frame: what a bare `assert` failed on."""
    for k in range(len(lines) - 1, -1, -1):
        m = _FRAME.match(lines[k])
        if m:
            path = m.group(1).split("site-packages/")[-1]
            code = next((x.strip() for x in lines[k + 1 :] if x.strip() and not set(x.strip()) <= set("^~ ")), "")
            return f"at {path}:{m.group(2)}" + (f": {code}" if code else "")
    return ""


def describe(cause: BaseException) -> str:
    """`Type: message` of the error that started it. An error whose text carries a remote traceback (an actor
    that died in its constructor: Ray keeps only the text) is named by that traceback's last line."""
    text = _ANSI.sub("", str(cause)).strip()
    if _FRAME.search(text):  # Ray drops the "Traceback (most recent call last):" line but keeps the frames
        lines = text.splitlines()
        for k in range(len(lines) - 1, -1, -1):
            m = _EXCEPTION_LINE.match(lines[k].strip())
            if m:
                name, message = m.group(1).rsplit(".", 1)[-1], (m.group(2) or "").strip()
                return f"{name}: {message}" if message else f"{name} {_where(lines[:k])}"
    return f"{type(cause).__name__}: {text.splitlines()[0] if text else ''}".rstrip(": ")


def failure_message(e: BaseException) -> str:
    cause = root_cause(e)
    if isinstance(cause, OSError) and cause.errno is not None:
        # Not str(): an OSError that crossed from a Ray worker carries Ray's retry message as its filename.
        what = f"{type(cause).__name__}: [Errno {cause.errno}] {cause.strerror}"
    else:
        what = describe(cause)
    what = what[:400]
    if isinstance(cause, OSError) and cause.errno == errno.ENOSPC:
        hint = "the output's storage is full; free space and rerun the same command"
    else:
        hint = "fix the cause and rerun the same command"
    return redact(
        f"the run failed: {what}. Everything committed before the failure is kept (no partial shard is ever "
        f"visible); {hint} to continue where it stopped."
    )

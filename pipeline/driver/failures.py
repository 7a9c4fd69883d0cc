"""What a run that failed mid-way tells its user: one line naming the root cause and what to do next."""

from __future__ import annotations

import errno

from pipeline.format.storage import redact


def root_cause(e: BaseException) -> BaseException:
    """The innermost exception: through `raise ... from`, implicit context, and Ray's task errors (`.cause`)."""
    seen: set[int] = set()
    while id(e) not in seen:
        seen.add(id(e))
        cause = getattr(e, "cause", None)
        nxt = cause if isinstance(cause, BaseException) else (e.__cause__ or e.__context__)
        if nxt is None:
            break
        e = nxt
    return e


def failure_message(e: BaseException) -> str:
    cause = root_cause(e)
    if isinstance(cause, OSError) and cause.errno is not None:
        # Not str(): an OSError that crossed from a Ray worker carries Ray's retry message as its filename.
        text = f"[Errno {cause.errno}] {cause.strerror}"
    else:
        text = str(cause).strip().splitlines()[0] if str(cause).strip() else ""
    what = f"{type(cause).__name__}: {text}"[:400]
    if isinstance(cause, OSError) and cause.errno == errno.ENOSPC:
        hint = "the output's storage is full; free space and rerun the same command"
    else:
        hint = "fix the cause and rerun the same command"
    return redact(
        f"the run failed: {what}. Everything committed before the failure is kept (no partial shard is ever "
        f"visible); {hint} to continue where it stopped."
    )

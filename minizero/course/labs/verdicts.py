"""The checker's words when the ranks give no result: a rank exited or died, or was stopped at the deadline
or in a stall -- said with where each rank was (a stack sample), in the learner's code.

The learner's file runs only in the ranks (:mod:`minizero.course.labs.loading`), so none of this can take the
checker down with it: a loop, an exit or a crash, at import or in a method, ends as one of these verdicts.
"""
from __future__ import annotations

import signal

from ...run.launch import RankError
from ...run.stacks import Frame
from .loading import shown
from .raised import Raised


def _signal(code: int) -> str:
    try:
        return signal.Signals(-code).name
    except ValueError:
        return f"signal {-code}"


def raised_at_import(raised: Raised) -> str:
    """What the import of the learner's file raised, in its words; a ``sys.exit()`` as the exit it is."""
    if raised.kind == "SystemExit":
        return f"your file called sys.exit({raised.message}) while being imported: it must only define your class"
    return f"{raised.kind}: {raised.message}"


def died(error: RankError, importing: bool) -> str:
    """A rank's process ended under a task: at import, an exit is the file's, a signal a crash."""
    code, rank = error.exitcode, error.rank
    if not importing or code is None:
        return str(error)
    if code >= 0:
        return (f"your file called os._exit({code}) while being imported (rank {rank} ended with exit status {code}): "
                f"it must only define your class")
    return f"rank {rank} died while importing your file (killed by {_signal(code)}: a crash in native code?)"


def where(frames: list[Frame] | None, path: str | None) -> str:
    """Where a rank was, from its stack sample: the learner's method and line, if the learner's file is on
    the stack; else the innermost frame."""
    if frames is None:
        return "no stack sample: it did not answer (frozen, or in native code that holds the GIL)"
    if not frames:
        return "no stack sample: its main thread had no frames"
    mine = [f for f in frames if path and f.filename == path]
    if not mine:
        return f"at {frames[-1]}"
    outer, inner = mine[0], mine[-1]
    what = "your file, being imported" if outer.function == "<module>" else f"your {outer.function}"
    at = f"{shown(inner.filename)}:{inner.lineno}" + (f" in {inner.function}" if inner.function != outer.function else "")
    return f"in {what}, at {at}" + (f": {inner.line}" if inner.line else "")


def stopped(error: RankError, path: str | None, deadline_s: float, importing: bool) -> str:
    """A run stopped at the deadline or in a stall: the launcher's reason, then where each unfinished rank was
    (ranks at the same line share one)."""
    reason = str(error).split("\nThe run was stopped")[0].strip()
    if "in no collective (the limit)" in reason:  # the deadline's verdict (RankPool.run_within), not a stall's
        reason += f" -- the checker's deadline: {deadline_s:g} s; --deadline SECONDS to change it"
        if importing:
            reason = f"your file was still being imported after {deadline_s:g} s: " + reason
    lines = [reason, "        where each rank was (a stack sample):"]
    places: dict[str, list[int]] = {}
    for rank, frames in sorted(error.stacks.items()):
        places.setdefault(where(frames, path), []).append(rank)
    for place, ranks in places.items():
        who = ", ".join(f"rank {r}" for r in ranks)
        lines.append(f"          {who}: {place}")
    return "\n".join(lines)

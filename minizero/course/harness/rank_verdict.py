"""A failure on the ranks, told as a verdict: which rank, what it raised, what to do -- in a few lines.

:class:`minizero.run.launch.RankError` carries the failing rank's whole traceback (``remote_traceback``), and the
parent's own traceback sits on top of it: 20 to 40 lines with the one that matters last.  The command line
prints the verdict instead; ``--debug`` adds both tracebacks for whoever has to read the code.
"""
from __future__ import annotations

import traceback

#: What to do after a rank raised, by the exception's class (the message itself usually says more).
ADVICE = {
    "FloatingPointError": "the run diverged: lower --lr, or check the data for inf/NaN",
    "CheckpointError": "the checkpoint it names cannot be written or trusted: its message says why; resume from "
                       "another step-N directory, or save somewhere else",
    "ValueError": "fix the input it names; the same command then runs",
    "MemoryError": "the ranks ran out of memory: a smaller --model or --batch-size, or fewer --world-size ranks",
}
GENERIC = "rerun with --debug for the rank's full traceback; if it names minizero's code, please report it"


def raised(remote_traceback: str) -> str:
    """The exception a rank raised, as Python prints it under the last frame of its traceback (with a chain
    of exceptions, the last one: the one that ended the rank)."""
    lines = remote_traceback.rstrip("\n").splitlines()
    frames = [i for i, line in enumerate(lines) if line.startswith('  File "')]
    if not frames:
        return remote_traceback.strip()
    rest = lines[frames[-1] + 1:]
    while rest and rest[0].startswith("    "):  # the frame's source line and its ^^^^ markers
        rest = rest[1:]
    return "\n".join(rest).strip() or lines[-1].strip()


def rank_error_verdict(error, debug: bool = False) -> str:
    """``error``: a RankError.  A raise on a rank: the rank, the exception, the advice.  A death or a stall:
    the watchdog's own verdict (already the rank, the cause and every rank's row), with no traceback to add."""
    if error.remote_traceback:
        cause = raised(error.remote_traceback)
        kind = cause.split(":", 1)[0].rsplit(".", 1)[-1]
        lines = [f"error: rank {error.rank} failed: {cause}",
                 f"  what to do: {ADVICE.get(kind, GENERIC)}",
                 "  (the other ranks were stopped; --debug prints the rank's full traceback)"]
    else:
        lines = [f"error: {error}", "  (--debug prints where the run was when it was stopped)"]
    if debug:
        here = "".join(traceback.format_exception(error)).rstrip()
        lines += ["", "--debug: the launching process's traceback:", here]
        if error.remote_traceback and error.remote_traceback not in here:
            lines += ["", f"--debug: rank {error.rank}'s traceback:", error.remote_traceback.rstrip()]
    return "\n".join(lines)

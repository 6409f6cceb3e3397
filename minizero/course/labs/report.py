"""A lab's verdict: which properties passed, and the first that failed, in the words a learner acts on.

A failure says what went wrong first -- the parameter, the rank, the step and the direction, or where a rank
stopped -- then the known mistake whose numbers it matches, then the (shrunk) case it happened on, and that the
derandomized examples replay it.
"""
from __future__ import annotations

from dataclasses import dataclass

SHRINK_S = 20.0  # at most this long shrinking a failure: each example is a distributed run


@dataclass
class Report:
    lab: str
    impl: str
    passed: list[str]
    failed: str | None = None  # the property
    why: str = ""
    case: str = ""
    mistake: str | None = None
    final: bool = False  # the ranks were stopped or died: the case is the first that did it, not shrunk
    shrink_s: float = SHRINK_S  # how long shrinking was allowed

    @property
    def ok(self) -> bool:
        return self.failed is None


def format_failure(report: Report) -> str:
    """What went wrong first -- the parameter, the rank, the step and the direction, or where a rank stopped --
    then the known mistake it matches, then the case it happened on."""
    lines = [f"  FAIL  {report.failed}", f"        what went wrong: {report.why}"]
    if report.mistake:
        lines.append(f"        a known mistake gives exactly these numbers: {report.mistake}")
    if report.case:
        lines.append(f"        {'failing case (not shrunk: the ranks were stopped)' if report.final else 'smallest failing case'}:"
                     f" {report.case}")
    if report.final:
        lines.append(f"lab {report.lab}: {report.failed} fails (the examples are derandomized: the same run replays it).")
    else:
        lines.append(f"lab {report.lab}: {report.failed} fails (the examples are derandomized: the same run replays it; "
                     f"shrinking stops after {report.shrink_s:g} s: the smallest case found by then).")
    return "\n".join(lines)

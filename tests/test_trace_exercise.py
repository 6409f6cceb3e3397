"""Lesson 5's exercise is an exam: a right reading of a trace passes, the blank and each slip fail on a small drawn
trace, the verdict saying what was said, what is right and the likely slip (each seen)."""
from __future__ import annotations

import pytest

from minizero.course.harness.trace_exercise import judge_exposed


def right(compute, comm):
    """Sweep the moments where anything starts or ends: exposed where some collective runs and no compute does."""
    moments = sorted({t for s, e in compute + comm for t in (s, e)})
    total = 0.0
    for a, b in zip(moments, moments[1:], strict=False):
        mid = (a + b) / 2
        if any(s <= mid < e for s, e in comm) and not any(s <= mid < e for s, e in compute):
            total += b - a
    return total


def all_communication(compute, comm):
    spans = sorted(comm)
    merged = []
    for s, e in spans:
        if merged and s <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], e)
        else:
            merged.append([s, e])
    return sum(e - s for s, e in merged)


def totals_subtracted(compute, comm):
    return sum(e - s for s, e in comm) - sum(e - s for s, e in compute)


def each_collective_alone(compute, comm):
    """Right for one collective at a time -- but two running at once are counted twice."""
    return sum(right(compute, [span]) for span in comm)


def blank(compute, comm):
    raise NotImplementedError


def test_a_right_reading_passes():
    ok, verdict = judge_exposed(right)
    assert ok and "200 drawn traces" in verdict, verdict


@pytest.mark.parametrize("fn, words", [
    (blank, "write my_exposed"),
    (all_communication, "too large -- that is all the communication: the part during which something computed"),
    (totals_subtracted, "subtract only where they overlap"),
    (each_collective_alone, "too large -- more than the communication's union: two collectives at once count once"),
    (lambda compute, comm: None, "return seconds, a number: got None"),
    (lambda compute, comm: right(compute, comm) * 1e3, "it reads as milliseconds: return seconds"),
    (lambda compute, comm: min(s for s, _ in comm) * 0 + right(compute, comm), "your function raised ValueError"),
    (lambda compute, comm: float("nan"), "a finite number: got nan"),
])
def test_each_slip_fails_on_a_small_trace_naming_it(fn, words):
    ok, verdict = judge_exposed(fn)
    assert not ok and words in verdict, verdict
    assert any(word in verdict for word in ("you said", "write", "return", "raised")), verdict

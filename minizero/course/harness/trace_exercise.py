"""Lesson 5's exercise: read a trace -- how much of a step's communication nothing hid.

A profiler's trace, minizero's timeline (:class:`~minizero.observe.timeline.StepTimeline`) and the figure of lesson
12 all say the same thing: spans of compute on one stream or thread, spans of communication on another.  What a
step pays for the network is the *exposed* communication: time during which some collective ran and nothing
computed.  The learner writes that reading, ``exposed(compute, comm)``; the judge draws traces as hypothesis draws
the suite's examples -- spans that overlap, nest, touch, or are empty; several collectives at once (a bucket's and a
prefetched unit's) -- and holds the answer to the timeline's own, the smallest failing trace told with what was
said and what is right.
"""
from __future__ import annotations

import math

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ...observe.timeline import length, minus, union

EXAMPLES = 200
TOLERANCE = 1e-9


def _spans(draw_from=st.integers(0, 40)):
    """Spans on a grid of 0.25 ms, 0 to 3 ms long (zero-length ones included); any right reading agrees to 1e-9 s."""
    return st.lists(st.tuples(draw_from, st.integers(0, 12)).map(lambda s: (s[0] * 2.5e-4, (s[0] + s[1]) * 2.5e-4)),
                    max_size=6)


def exposed_s(compute: list[tuple[float, float]], comm: list[tuple[float, float]]) -> float:
    """The answer key: the union of the communication less the union of the compute."""
    return length(minus(union(comm), union(compute)))


def _words(compute, comm, said, want) -> str:
    shown = lambda spans: "[" + ", ".join(f"({s * 1e3:g}, {e * 1e3:g})" for s, e in spans) + "]"  # noqa: E731
    hint = ""
    if want > 0 and math.isclose(said, want * 1e3, rel_tol=1e-9):
        hint = " -- it reads as milliseconds: return seconds"
    elif math.isclose(said, length(union(comm)), abs_tol=TOLERANCE):
        hint = " -- that is all the communication: the part during which something computed is hidden"
    elif said > length(union(comm)):
        hint = " -- more than the communication's union: two collectives at once count once"
    elif math.isclose(said, sum(e - s for s, e in comm) - sum(e - s for s, e in compute), abs_tol=TOLERANCE):
        hint = " -- that is the communication's total less the compute's: subtract only where they overlap"
    way = "too large" if said > want else "too small"
    return (f"on the trace compute {shown(compute)} ms, communication {shown(comm)} ms: you said "
            f"{said * 1e3:g} ms exposed, it is {want * 1e3:g} ms: {way}{hint}")


def judge_exposed(fn, examples: int = EXAMPLES) -> tuple[bool, str]:
    """``(passed, verdict)`` for ``fn(compute, comm)`` -- lists of ``(start, end)`` seconds -- returning the exposed
    seconds, on ``examples`` drawn traces, derandomized (the same traces every run)."""
    found: list[str] = []

    @settings(max_examples=examples, derandomize=True, deadline=None, database=None,
              suppress_health_check=list(HealthCheck))
    @given(compute=_spans(), comm=_spans())
    def holds(compute, comm):
        want = exposed_s(compute, comm)
        try:
            said = fn(list(compute), list(comm))
        except NotImplementedError:
            found[:] = ["write my_exposed: it still raises NotImplementedError"]
            raise AssertionError from None
        except Exception as error:  # noqa: BLE001 -- the learner's error, in words, on the smallest trace
            found[:] = [f"on the trace compute {compute}, communication {comm} (seconds) your function raised "
                        f"{type(error).__name__}: {error}"]
            raise AssertionError from None
        try:
            said = float(said)
        except (TypeError, ValueError):
            found[:] = [f"return seconds, a number: got {said!r}"]
            raise AssertionError from None
        if not math.isfinite(said):
            found[:] = [f"return seconds, a finite number: got {said!r} on compute {compute}, communication {comm}"]
            raise AssertionError
        if abs(said - want) > TOLERANCE:
            found[:] = [_words(compute, comm, said, want)]  # the last failure seen is the shrunk one
            raise AssertionError

    try:
        holds()
    except Exception:  # noqa: BLE001 -- hypothesis's verdict; ours is in found
        if found:
            return False, found[0]
        raise
    return True, (f"{examples} drawn traces (overlapping, nested, touching and empty spans; collectives at once): "
                  f"your reading is the timeline's, to {TOLERANCE:g} s")

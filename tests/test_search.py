"""The search the labs' checker and ``verify`` share (:mod:`minizero.course.labs.search`), on cases that cost nothing to
run: a failing case is run once, ``shrink_s=0`` reports the first failing draw, and a final failure is not shrunk."""
from __future__ import annotations

from collections import Counter

import pytest
from hypothesis import strategies as st

from minizero.course.labs.failed import Failed
from minizero.course.labs.search import Search


class Searcher(Search):
    def __init__(self, examples: int, shrink_s: float):
        self.examples, self.shrink_s = examples, shrink_s


DRAWN = st.tuples(st.integers(0, 1000))


def _search(shrink_s: float, examine) -> Failed:
    with pytest.raises(Failed) as failed:
        Searcher(50, shrink_s).search(DRAWN, examine, lambda x: f"x = {x}")
    return failed.value


def test_a_failing_case_is_run_once_and_shrunk_to_the_smallest():
    """Each case is a distributed run: hypothesis's replays of the failure it reports are answered from the first
    run (they once ran it again, a second or more of every failing check)."""
    runs = Counter()

    def examine(drawn):
        runs[drawn] += 1
        return ("too large", None) if drawn[0] >= 10 else None

    failed = _search(60.0, examine)
    assert failed.case == "x = 10" and failed.why == "too large"
    assert max(runs.values()) == 1, [k for k, v in runs.items() if v > 1]


def test_without_shrinking_the_first_failing_draw_is_the_verdict():
    """``shrink_s=0``: the case reported is the first drawn one that fails -- the same on any machine, where a
    bound in seconds reports whichever smaller case a busy machine reached in time."""
    order = []

    def examine(drawn):
        order.append(drawn)
        return ("too large", None) if drawn[0] >= 10 else None

    failed = _search(0.0, examine)
    first = next(x for (x,) in order if x >= 10)
    assert failed.case == f"x = {first}" and order.count((first,)) == 1
    assert order[-1] == (first,)  # nothing was run after it


def test_a_run_whose_ranks_were_stopped_is_final_and_not_shrunk():
    runs = Counter()

    def examine(drawn):
        runs[drawn] += 1
        if drawn[0] >= 10:
            raise Failed("rank 1 was stopped", final=True)
        return None

    failed = _search(60.0, examine)
    assert failed.final and failed.why == "rank 1 was stopped"
    failing = [k for k in runs if k[0] >= 10]
    assert len(failing) == 1 and runs[failing[0]] == 1

"""The search for a smallest failing case: what ``check`` (a lab) and ``verify`` (anyone's wrapper) share.

Hypothesis draws examples, derandomized -- the same examples every run, so a failure replays -- and each is run
by ``examine``; the first that fails is shrunk towards the simplest case that still fails, within ``shrink_s``
(each example is a distributed run: shrinking is paid in seconds).  A run whose ranks were stopped or died is
final: it is not replayed, nor shrunk.  The verdict is :class:`~minizero.course.labs.failed.Failed`: what went
wrong, on which case, and -- where ``diagnose`` recognises the numbers -- which known mistake it is.
"""
from __future__ import annotations

import time
from typing import Callable

from hypothesis import HealthCheck, Phase, given, reporting, settings

from .failed import Failed


class _Falsified(Exception):
    """Raised from one line only: hypothesis then sees one bug, not several, and shrinks it."""


def search(strategy, examine: Callable, describe: Callable, examples: int, shrink_s: float,
           diagnose: Callable | None = None) -> None:
    """Draw ``examples`` cases from ``strategy`` until ``examine(drawn)`` returns ``(why, results)`` (None: it
    holds); shrink; raise :class:`Failed` with ``describe(*drawn)`` and ``diagnose(*drawn, results)``'s name."""
    best: dict = {}

    @settings(max_examples=examples, derandomize=True, database=None, deadline=None, print_blob=False,
              report_multiple_bugs=False, suppress_health_check=list(HealthCheck),
              phases=[Phase.explicit, Phase.generate, Phase.shrink])
    @given(drawn=strategy)
    def prop(drawn):
        key = repr(drawn)
        if best.get("final"):  # the ranks were stopped or died: no replay, nothing to shrink
            if key == best["key"]:
                raise _Falsified(best["why"])
            return
        if best and time.monotonic() > best["until"] and key != best["key"]:
            return  # shrinking's time is spent: only the smallest failure so far is replayed
        try:
            found = examine(drawn)
        except Failed as failed:
            found = (failed.why, None)
            best["final"] = failed.final
        if found is not None:
            until = best.get("until", time.monotonic() + shrink_s)
            best.update(key=key, drawn=drawn, why=found[0], results=found[1], until=until)
            raise _Falsified(found[0])

    with reporting.with_reporter(lambda *_: None):
        try:
            prop()
        except Exception:  # noqa: BLE001 -- _Falsified, or hypothesis's own verdict on a flaky failure
            if not best:
                raise
    if best:
        drawn = best["drawn"]
        mistake = diagnose(*drawn, best["results"]) if diagnose and best["results"] is not None else None
        raise Failed(best["why"], describe(*drawn), mistake, final=best.get("final", False))

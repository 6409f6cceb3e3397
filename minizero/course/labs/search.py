"""The search for a smallest failing case: what ``check`` (a lab) and ``verify`` (anyone's wrapper) share.

Hypothesis draws examples, derandomized -- the same examples every run, so a failure replays -- and each is run
by ``examine``; the first that fails is shrunk towards the simplest case that still fails, within ``shrink_s``
(each example is a distributed run: shrinking is paid in seconds).  A failing case is run once: hypothesis's
replays of it are answered with the verdict it gave.  A run whose ranks were stopped or died is final: not
shrunk.  The verdict is :class:`~minizero.course.labs.failed.Failed`: what went wrong, on which case, and -- where
``diagnose`` recognises the numbers -- which known mistake it is.

Derandomized means seeded from the drawing function's own source (hypothesis's ``function_digest``): the text of
``prop`` below is the seed of every lab's examples -- change a character and each lab draws other cases.
"""
from __future__ import annotations

import time

from hypothesis import HealthCheck, Phase, given, reporting, settings

from .failed import Failed


class _Falsified(Exception):
    """Raised from one line only: hypothesis then sees one bug, not several, and shrinks it."""


def _run_once(examine, best: dict):
    """``examine``, but the case that failed last is answered with its verdict, not run again: hypothesis replays
    the failure it reports, and each run is a distributed one (a second of a lab's check, or more)."""
    def once(drawn):
        if best and repr(drawn) == best["key"]:
            return best["why"], best["results"]
        return examine(drawn)
    return once


class Search:
    """Mixed into what searches: it has ``examples`` (how many to draw), ``shrink_s`` (how long shrinking may
    take) and ``diagnose(exp, world_size, results)`` (a known mistake's name, or None)."""

    examples: int
    shrink_s: float

    def diagnose(self, exp, world_size: int, results) -> str | None:
        return None

    def search(self, strategy, examine, describe) -> None:
        """Draw examples until ``examine(drawn)`` returns ``(why, results)``; shrink; raise :class:`Failed`."""
        best: dict = {}
        examine = _run_once(examine, best)  # (not in prop: its text seeds every lab's draws)

        @settings(max_examples=self.examples, derandomize=True, database=None, deadline=None, print_blob=False,
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
                until = best.get("until", time.monotonic() + self.shrink_s)
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
            case = describe(*drawn)
            mistake = self.diagnose(*drawn, best["results"]) if best["results"] is not None else None
            raise Failed(best["why"], case, mistake, final=best.get("final", False))

    def fixed(self, cases, examine, describe) -> None:
        """``examine`` each of ``cases`` -- tried whatever is drawn, for the branches a few draws may miss -- and raise
        :class:`Failed` on the first that fails, not shrunk (it is already small), with its known mistake if
        ``diagnose`` recognises the numbers."""
        for case in cases:
            try:
                found = examine(case)
            except Failed as failed:
                raise Failed(failed.why, describe(*case), final=failed.final) from None
            if found:
                why, results = found
                raise Failed(why, describe(*case), self.diagnose(*case, results) if results is not None else None)

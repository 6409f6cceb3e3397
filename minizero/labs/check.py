"""``python -m minizero check LAB --impl FILE``: judge a learner's stage with the package's own properties.

Each property of the lab runs in turn (``PASS``/``FAIL`` printed as it ends).
Drawn properties run hypothesis derandomized -- the same examples every run, so
a failure replays -- and a failure is shrunk to the smallest case that still
fails, then reported in plain words: the case, what differed, and, when the
numbers match one of the lab's known mistakes, which mistake it is.
Examples run on persistent pools of ranks (one per world size), as in the suite.
"""
from __future__ import annotations

import re
import time
from dataclasses import dataclass, field, replace

from hypothesis import HealthCheck, Phase, given, reporting, settings

from ..lab.equivalence import judge
from ..lab.experiment import reference_of
from ..launch import RankError, RankPools
from ..precision import Precision
from .catalogue import LABS, Lab, check_lab_name
from .loading import Impl
from .properties import PROPERTIES, Failed, describe
from .ranks import Raised, lab_experiment

SHRINK_S = 20.0  # at most this long shrinking a failure: each example is a distributed run


class _Falsified(Exception):
    """Raised from one line only: hypothesis then sees one bug, not several, and shrinks it."""


@dataclass
class Checker:
    lab: Lab
    impl: Impl
    pools: RankPools
    examples: int = 25
    shrink_s: float = SHRINK_S
    precision: str = "fp32"  # mixed precision for every example: the stage in the ZeRO paper's setting (lesson 8)
    stages: dict = field(init=False)

    def __post_init__(self):
        self.stages = self.impl.stages()  # loads the learner's file here (the ranks load it themselves)

    @property
    def options(self) -> dict:
        """Stage options every example uses: the lab's, and the precision asked for."""
        return {**self.lab.options, **({"precision": Precision(self.precision)} if self.precision != "fp32" else {})}

    @property
    def key(self) -> str:
        return self.impl.key

    def run(self, world_size: int, exp) -> list:
        """Every rank's result of ``exp`` with the learner's class; a rank's exception, a stall or a death
        raises :class:`Failed` naming it."""
        # Without the registry: a class from the learner's file is loaded by each rank, not unpickled.
        return self.on_ranks(world_size, lab_experiment, self.impl, replace(exp, stages=None))

    def run_case(self, world_size: int, exp) -> list:
        """:meth:`run` for a fixed case: a failure names the case."""
        try:
            return self.run(world_size, exp)
        except Failed as failed:
            raise Failed(failed.why, describe(exp, world_size)) from None

    def on_ranks(self, world_size: int, fn, *args) -> list:
        """``fn`` on every rank.  A stall or a death -- the pool is replaced for the next example -- or an
        exception a rank reported raises :class:`Failed` naming the rank.  When ranks failed apart (not all,
        or not alike), messages one sent may be unread by another: the pool goes too."""
        try:
            results = self.pools.run(world_size, fn, *args)
        except RankError as error:
            why = str(error).split("\nThe run was stopped")[0].strip()
            if "exit code -6" in why:  # gloo aborts a process whose receive does not match what was sent
                why += (" -- gloo aborts a rank that receives a message of another size than it posted: each step's "
                        "send must be the chunk its neighbour receives")
            raise Failed(why) from None
        raised = [r for r in results if isinstance(r, Raised)]
        if raised:
            alike = {(r.kind, re.sub(r"\brank \d+\b", "rank #", r.message)) for r in raised}
            if len(alike) > 1 or len(raised) < world_size:
                pool = self.pools.live().get(world_size)
                if pool is not None:
                    pool.close(kill=True)
            raise Failed(str(raised[0]))
        return results

    def search(self, strategy, examine, describe) -> None:
        """Draw examples until ``examine(drawn)`` returns ``(why, results)``; shrink; raise :class:`Failed`."""
        best: dict = {}

        @settings(max_examples=self.examples, derandomize=True, database=None, deadline=None, print_blob=False,
                  report_multiple_bugs=False, suppress_health_check=list(HealthCheck),
                  phases=[Phase.explicit, Phase.generate, Phase.shrink])
        @given(drawn=strategy)
        def prop(drawn):
            key = repr(drawn)
            if best and time.monotonic() > best["until"] and key != best["key"]:
                return  # shrinking's time is spent: only the smallest failure so far is replayed
            try:
                found = examine(drawn)
            except Failed as failed:
                found = (failed.why, None)
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
            raise Failed(best["why"], case, mistake)

    # ------------------------------------------------------------ naming the mistake
    def diagnose(self, exp, world_size: int, results) -> str | None:
        """The known mistake whose run of this very case gives the learner's numbers, if one does."""
        for mistake in self.lab.mistakes:
            try:
                theirs = self.run(world_size, replace(exp, stage=mistake.name))
            except Failed:
                continue
            same = all(judge([mine], its, exp.dtype).ok for mine, its in zip(results, theirs))
            if same and not judge(theirs, reference_of(replace(exp, stages=self.stages), world_size), exp.dtype).ok:
                return mistake.mistake
        return None

    def diagnose_cost(self, exp, world_size: int, sent: float) -> str | None:
        """The known mistake that sends exactly the learner's bytes on this case, if one does."""
        for mistake in self.lab.mistakes:
            try:
                theirs = self.run(world_size, replace(exp, stage=mistake.name))
            except Failed:
                continue
            if sum(r.sent_bytes for r in theirs) / (world_size * exp.steps) == sent:
                return mistake.mistake
        return None


@dataclass
class Report:
    lab: str
    impl: str
    passed: list[str]
    failed: str | None = None  # the property
    why: str = ""
    case: str = ""
    mistake: str | None = None

    @property
    def ok(self) -> bool:
        return self.failed is None


def check(lab: str, impl=None, examples: int = 25, pools: RankPools | None = None, out=print,
          shrink_s: float = SHRINK_S, precision: str = "fp32") -> Report:
    """Judge ``impl`` -- a file, a class, or None for the package's own (the answer key) -- by lab ``lab``'s
    properties, printing each as it passes; stop at the first that fails.  Returns the :class:`Report`."""
    spec = check_lab_name(lab)
    implementation = Impl.of(spec, impl)
    own = pools is None
    pools = RankPools(timeout_s=10.0) if own else pools
    Precision(precision)  # an unknown name is refused here, naming the valid ones
    if precision != "fp32" and not spec.precision:
        raise ValueError(f"lab {spec.name!r} is not checked under mixed precision; labs that are: "
                         f"{', '.join(n for n, lab in LABS.items() if lab.precision)}")
    out(f"lab {spec.name}: {spec.title}  ({spec.lesson})" + (f", in {precision} mixed precision" if precision != "fp32"
                                                              else ""))
    out(f"checking {implementation.label}")
    report = Report(spec.name, implementation.label, [])
    try:
        try:
            checker = Checker(spec, implementation, pools, examples, shrink_s, precision)
        except Exception as error:  # noqa: BLE001 -- the file does not load: say why, in its words
            report.failed, report.why = "loading your file", f"{type(error).__name__}: {error}"
            out(format_failure(report))
            return report
        for name in spec.properties:
            title, prop = PROPERTIES[name]
            start = time.monotonic()
            try:
                detail = prop(checker)
            except Failed as failed:
                report.failed, report.why, report.case, report.mistake = title, failed.why, failed.case, failed.mistake
                out(format_failure(report))
                return report
            report.passed.append(title)
            out(f"  PASS  {title}: {detail}  ({time.monotonic() - start:.1f} s)")
        out(f"lab {spec.name}: every property holds.")
        return report
    finally:
        if own:
            pools.close()


def format_failure(report: Report) -> str:
    lines = [f"  FAIL  {report.failed}"]
    if report.case:
        lines.append(f"        smallest failing case: {report.case}")
    lines.append(f"        what went wrong: {report.why}")
    if report.mistake:
        lines.append(f"        a known mistake gives exactly these numbers: {report.mistake}")
    lines.append(f"lab {report.lab}: {report.failed} fails (the examples are derandomized: the same run replays it; "
                 f"shrinking stops after {SHRINK_S:g} s: the smallest case found by then).")
    return "\n".join(lines)

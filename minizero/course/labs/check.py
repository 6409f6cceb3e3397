"""``python -m minizero check LAB --impl FILE``: judge a learner's stage with the package's own properties.

Each property of the lab runs in turn (``PASS``/``FAIL`` printed as it ends).
Drawn properties run hypothesis derandomized -- the same examples every run, so
a failure replays -- and a failure is shrunk to the smallest case that still
fails, then reported in plain words: the case, what differed, and, when the
numbers match one of the lab's known mistakes, which mistake it is.
Examples run on persistent pools of ranks (one per world size), as in the suite.

The learner's file is imported and run only in the ranks, under a deadline: a
rank that spends ``deadline_s`` in no collective -- a loop in the learner's code,
at import or in a method, on every rank or on one -- is stopped and the verdict
says where it was (a stack sample); so is a stall inside a collective.  An exit
or a crash is a verdict too.  The pool is killed, and respawned for what follows.
"""
from __future__ import annotations

import re
import tempfile
import time
import weakref
from dataclasses import dataclass, field, replace

from ...parts.precision import Precision
from ...run.launch import RankError
from ...run.pools import RankPools
from ..harness.equivalence import judge
from ..harness.experiment import reference_of
from .catalogue import LABS, Lab, check_lab_name
from .failed import Failed, describe
from .loading import Impl
from .property_table import PROPERTIES
from .raised import Raised
from .ranks import gloo_words, import_file, lab_experiment, stderr_to
from .report import SHRINK_S, Report, format_failure
from .search import Search
from .verdicts import died, raised_at_import, stopped

DEADLINE_S = 30.0  # a rank this long in no collective is stopped: the checker's examples take well under a second


#: The package's own runs (the answer key's, a known mistake's) by case, per set of pools.  They do not depend on the
#: file being checked, so a suite judging many files by one lab on the same pools runs each once (:meth:`Checker.package`).
_PACKAGE_RUNS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


@dataclass
class Checker(Search):
    lab: Lab
    impl: Impl
    pools: RankPools
    examples: int = 25
    shrink_s: float = SHRINK_S
    precision: str = "fp32"  # mixed precision for every example: the stage in the ZeRO paper's setting (lesson 10)
    deadline_s: float = DEADLINE_S
    stages: dict = field(init=False)
    _imported: weakref.WeakSet = field(init=False, default_factory=weakref.WeakSet)  # pools that loaded the file
    _cases: dict = field(init=False, default_factory=dict)  # the learner's runs of fixed cases, by case

    def __post_init__(self):
        self.stages = self.impl.stand_in_stages()  # the learner's file is imported by the ranks alone
        self._noise = tempfile.TemporaryDirectory(prefix="minizero-check-")  # the ranks' C-level stderr

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
        """:meth:`run` for a fixed case: a failure names the case.  Run once per check: the cost properties
        measure the same runs (the bytes of each step, then the model state held after them)."""
        key = (world_size, repr(exp))
        if key not in self._cases:
            try:
                self._cases[key] = self.run(world_size, exp)
            except Failed as failed:
                raise Failed(failed.why, describe(exp, world_size), final=failed.final) from None
        return self._cases[key]

    def package(self, world_size: int, exp) -> list:
        """Every rank's result of ``exp`` with the package's own stage ``exp.stage`` (the answer key, a known
        mistake): the same whoever's file is checked, so kept with the pools for the next check -- unless the case
        runs over the learner's own class (a ring lab's backend), which this check alone may use."""
        key = (world_size, repr(exp))
        if self.key in key[1]:
            return self.run(world_size, exp)
        runs = _PACKAGE_RUNS.setdefault(self.pools, {})
        if key not in runs:
            runs[key] = self.run(world_size, exp)
        return runs[key]

    def load(self, world_size: int = 2) -> None:
        """The learner's file imported on the pool of ``world_size`` ranks (once per pool: a respawned pool
        imports it again), or :class:`Failed` saying what the import did instead."""
        pool = self.pools.pool(world_size)
        if pool not in self._imported:
            self._on_ranks(world_size, import_file, self.impl, importing=True)
            self._imported.add(pool)

    def on_ranks(self, world_size: int, fn, *args) -> list:
        """``fn`` on every rank, after the learner's file is imported there.  A stall, the deadline or a
        death -- the pool is replaced for the next example -- or an exception a rank reported raises
        :class:`Failed` naming the rank."""
        self.load(world_size)
        return self._on_ranks(world_size, fn, *args)

    def _on_ranks(self, world_size: int, fn, *args, importing: bool = False) -> list:
        """When ranks failed apart (not all, or not alike), messages one sent may be unread by another: the
        pool goes too."""
        try:
            results = self.pools.run_within(self.deadline_s, world_size, stderr_to, self._noise.name, fn, *args)
        except RankError as error:
            alone = [r for r in error.finished.values() if isinstance(r, Raised)]
            if alone and error.exitcode is None:  # the cause: a rank raised alone, and its peers waited for it
                who = " and ".join(f"rank {r.rank}" for r in sorted(alone, key=lambda r: r.rank))
                raise Failed(f"{alone[0]}\n    ({who} raised alone: the other ranks, waiting in a collective for what "
                             f"{'it' if len(alone) == 1 else 'they'} would have sent, were stopped)", final=True) from None
            if error.exitcode is not None:
                why = died(error, importing)
            elif error.stacks:
                why = stopped(error, self.impl.path, self.deadline_s, importing)
            else:
                why = str(error).split("\nThe run was stopped")[0].strip()
            said = gloo_words(self._noise.name)
            if said:
                why += f"\n        gloo's own words, {said}"
            if "exit code -6" in why:  # gloo aborts a process whose receive does not match what was sent
                why += ("\n        gloo aborts a rank that receives a message of another size than it posted: each "
                        "step's send must be the chunk its neighbour receives")
            raise Failed(why, final=True) from None  # nothing to shrink: each replay would cost the same wait
        raised = [r for r in results if isinstance(r, Raised)]
        if raised:
            alike = {(r.kind, re.sub(r"\brank \d+\b", "rank #", r.message)) for r in raised}
            if len(alike) > 1 or len(raised) < world_size:
                pool = self.pools.live().get(world_size)
                if pool is not None:
                    pool.close(kill=True)
            raise Failed(raised_at_import(raised[0]) if importing else str(raised[0]), final=importing)
        return results

    # ------------------------------------------------------------ naming the mistake
    def diagnose(self, exp, world_size: int, results) -> str | None:
        """The known mistake whose run of this very case gives the learner's numbers, if one does -- confirmed on a
        second case: on the smallest case two different slips often give the same numbers (one SGD step cannot
        tell averaging the parameters from never averaging at all), so a match is named only if it also agrees on
        two steps of K = 2 on a plain MLP, on at least two ranks, the learner's own class run again."""
        matching = [m for m in self.lab.mistakes if self._same_as(m.name, exp, world_size, results)]
        if not matching:
            return None
        second = replace(exp, task="mlp", model={"sizes": (3, 5, 2)}, accum=2, steps=2, wrap_first=False,
                         record_states=True, rank_sizes=None)
        n = max(world_size, 2)  # (on one rank, a mistake in averaging averages nothing)
        try:
            mine = self.run(n, second)
        except Failed:
            return None  # the learner's class raised where the mistake did not: not the same mistake
        matching = [m for m in matching if self._same_as(m.name, second, n, mine)]
        return matching[0].mistake if len(matching) == 1 else None

    def _same_as(self, stage: str, exp, world_size: int, results) -> bool:
        """Does ``stage`` give ``results`` on ``exp`` -- and are they wrong (judged as the property judged)?"""
        try:
            theirs = self.package(world_size, replace(exp, stage=stage))
        except Failed:
            return False
        states = exp.record_states
        same = all(judge([mine], its, exp.dtype, states=states).ok for mine, its in zip(results, theirs, strict=True))
        return same and not judge(theirs, reference_of(replace(exp, stages=self.stages), world_size), exp.dtype,
                                  states=states).ok

    def diagnose_cost(self, exp, world_size: int, sent: float, kinds: set[str] | None = None) -> str | None:
        """The known mistake that sends exactly the learner's bytes on this case, by the same ``kinds`` of
        collective when given (forgetting that the parameters were shared sends 1.5x ZeRO-1's bytes as a
        reduce-scatter and two all-gathers -- not the all-reduce and all-gather of the mistake with that ratio)."""
        for mistake in self.lab.mistakes:
            try:
                theirs = self.package(world_size, replace(exp, stage=mistake.name))
            except Failed:
                continue
            if sum(r.sent_bytes for r in theirs) / (world_size * exp.steps) == sent and (
                    kinds is None or set(theirs[0].sent_by_kind) == kinds):
                return mistake.mistake
        return None


def check(lab: str, impl=None, examples: int = 25, pools: RankPools | None = None, out=print,
          shrink_s: float = SHRINK_S, precision: str = "fp32", deadline_s: float = DEADLINE_S) -> Report:
    """Judge ``impl`` -- a file, a class, or None for the package's own (the answer key) -- by lab ``lab``'s
    properties, printing each as it passes; stop at the first that fails.  Returns the :class:`Report`.
    ``deadline_s``: how long a rank may spend in no collective (importing the file included) before it is
    stopped and the verdict says where it was."""
    spec = check_lab_name(lab)
    if not deadline_s > 0:
        raise ValueError(f"--deadline must be more than 0 seconds, got {deadline_s!r}")
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
    out(f"  (a rank {deadline_s:g} s in no collective -- your code looping, say -- or {pools.timeout_s:g} s without "
        f"progress in one is stopped and shown where it was; --deadline SECONDS)")
    report = Report(spec.name, implementation.label, [], shrink_s=shrink_s)
    try:
        checker = Checker(spec, implementation, pools, examples, shrink_s, precision, deadline_s)
        try:
            checker.load()
        except Failed as failed:  # the file does not load in the ranks: say why, in its words
            report.failed, report.why, report.final = "loading your file", failed.why, True
            out(format_failure(report))
            return report
        for name in (spec.yours, *spec.properties):  # first: the learner's methods are what runs
            title, prop = PROPERTIES[name]
            start = time.monotonic()
            try:
                detail = prop(checker)
            except Failed as failed:
                report.failed, report.why, report.case, report.mistake = title, failed.why, failed.case, failed.mistake
                report.final = failed.final
                out(format_failure(report))
                return report
            report.passed.append(title)
            out(f"  PASS  {title}: {detail}  ({time.monotonic() - start:.1f} s)")
        out(f"lab {spec.name}: every property holds.")
        return report
    finally:
        if own:
            pools.close()

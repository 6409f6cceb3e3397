"""Helpers of the equivalence suite: draw an experiment, run it, check it."""
from __future__ import annotations

import functools
import os
from dataclasses import replace

from minizero.course.harness import drawn
from minizero.course.harness.diagnosis import what_is_wrong
from minizero.course.harness.drawn import BUCKET_MB, PRECISION_POLICIES, stage_options
from minizero.course.harness.equivalence import bit_identical, judge, optimizer_state_violation
from minizero.course.harness.experiment import Experiment, reference_of, run_experiment

#: ``make test-deep`` sets MINIZERO_DEEP: every property draws 20 times as many, fresh, examples.
DEEP = bool(os.environ.get("MINIZERO_DEEP"))


def examples(n: int) -> int:
    return 20 * n if DEEP else n


WORLD_SIZES = (1, 2, 3, 4)

#: Every experiment drawn in this process, with the world sizes its strategy draws from: what :func:`covering`
#: looks at.
_DRAWN: list[tuple] = []


def experiments(*args, world_sizes=WORLD_SIZES, **kwargs):
    """:func:`minizero.course.harness.drawn.experiments`, each draw noted for :func:`covering` (``map`` leaves the draws
    themselves, and so the derandomized examples, as they were)."""
    return drawn.experiments(*args, world_sizes=world_sizes, **kwargs).map(
        lambda pair: _DRAWN.append((pair, world_sizes)) or pair)


def missing_cases(noted: list[tuple]) -> list[str]:
    """What the suite promises every property covers, and these draws do not: each world size the strategy
    draws from (3 shards unevenly), accumulation (K >= 2) across ranks, unequal batches across ranks."""
    if not noted:
        return ["any draw"]
    ran, sizes = [pair for pair, _ in noted], set(noted[0][1])
    missing = [f"world size {n}" for n in sorted(sizes - {n for _, n in ran})]
    if max(sizes) >= 2 and not any(n >= 2 and exp.accum >= 2 for exp, n in ran):
        missing.append("K >= 2 on more than one rank")
    if max(sizes) >= 2 and not any(n >= 2 and exp.rank_sizes is not None and len(set(exp.rank_sizes)) > 1
                                   for exp, n in ran):
        missing.append("unequal batches across ranks")
    return missing


def covering(test):
    """A property's examples are a fixed handful (derandomized, ``examples(n)``): this checks, after the property
    passed, that they covered :func:`missing_cases`' list, so a change that reshuffles the draws cannot quietly
    drop, say, world size 3.  Put it above ``@settings``."""
    @functools.wraps(test)
    def property_then_coverage(*args, **kwargs):
        start = len(_DRAWN)
        test(*args, **kwargs)
        missing = missing_cases(_DRAWN[start:]) + drawn.missing_clip_sides([exp for (exp, _), _ in _DRAWN[start:]])
        assert not missing, f"the drawn examples never had {', '.join(missing)}: raise this property's examples(n)"
    return property_then_coverage


def covering_every_world_size(test):
    """:func:`covering` for a grid of ``stage`` x ``world_size`` (:data:`WORLD_SIZES`), parametrized rather than
    drawn because one test's parametrizations share hypothesis's seed: a stage's cells are judged together,
    once its last one has run."""
    cells: dict = {}

    @functools.wraps(test)
    def property_then_coverage(*args, stage, world_size, **kwargs):
        start = len(_DRAWN)
        test(*args, stage=stage, world_size=world_size, **kwargs)
        mine = cells.setdefault(stage, {})
        mine[world_size] = [pair for pair, _ in _DRAWN[start:]]
        if set(mine) == set(WORLD_SIZES):
            missing = missing_cases([(pair, WORLD_SIZES) for drawn in mine.values() for pair in drawn])
            assert not missing, f"{stage}: the drawn examples never had {', '.join(missing)}: raise examples(n)"
    return property_then_coverage


def assert_equivalent(results: list, reference, exp: Experiment, rtol: float | None = None) -> None:
    """The one definition of equivalent (:func:`minizero.course.harness.equivalence.judge`), as an assertion -- which, when it
    fails, says what the labs' checker would say (:func:`minizero.course.harness.diagnosis.what_is_wrong`): the parameter,
    the rank, the step, the ratio and the direction."""
    verdict = judge(results, reference, exp.dtype, rtol, states=exp.record_states)
    if not verdict.ok:
        why = what_is_wrong(results, reference, exp, len(results)) if rtol is None else None
        raise AssertionError(f"{why or verdict.nonfinite or verdict.violation}  ({exp})")


def assert_same_optimizer_state(got: dict, want: dict, rtol: float, where: str) -> None:
    violation = optimizer_state_violation(got, want, rtol, where)
    assert violation is None, violation


def run_and_check(pools, exp: Experiment, world_size: int, rtol: float | None = None) -> list[dict]:
    results = pools.run(world_size, run_experiment, exp)
    assert_equivalent(results, reference_of(exp, world_size), exp, rtol)
    return results


__all__ = ["BUCKET_MB", "PRECISION_POLICIES", "stage_options", "experiments",
           "assert_equivalent", "run_and_check", "bit_identical", "replace", "examples", "covering",
           "covering_every_world_size", "WORLD_SIZES"]


def train_here(me, exp, after_step=lambda: None) -> None:
    """Train ``exp`` on this rank (from a pool), float32, then close its Comm: for a test that watches a stage from
    inside, having patched what it watches before the stage is built (its parts hold bound methods)."""
    import torch

    from minizero.course.harness.experiment import build
    from minizero.course.harness.tasks import TASKS
    from minizero.run.train import shard_step, train_step
    stage, _, comm, _ = build(me, exp)
    try:
        for s in range(exp.steps):
            x, y = TASKS[exp.task].make_batch(exp.global_batch(me.world_size), exp.seed, s, torch.float32, **exp.model)
            train_step(stage, shard_step(x, y, me.rank, me.world_size, exp.accum))
            after_step()
    finally:
        comm.close()

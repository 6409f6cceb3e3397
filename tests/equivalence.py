"""Helpers of the equivalence suite: draw an experiment, run it, check it."""
from __future__ import annotations

import os
from dataclasses import replace

from minizero.lab.drawn import BUCKET_MB, PRECISION_POLICIES, experiments, stage_options
from minizero.lab.equivalence import bit_identical, judge, optimizer_state_violation
from minizero.lab.experiment import Experiment, reference_of, run_experiment

#: ``make test-deep`` sets MINIZERO_DEEP: every property draws 20 times as many, fresh, examples.
DEEP = bool(os.environ.get("MINIZERO_DEEP"))


def examples(n: int) -> int:
    return 20 * n if DEEP else n


def assert_equivalent(results: list, reference, exp: Experiment, rtol: float | None = None) -> None:
    """The one definition of equivalent (:func:`minizero.lab.equivalence.judge`), as an assertion."""
    verdict = judge(results, reference, exp.dtype, rtol, states=exp.record_states)
    assert verdict.ok, f"{verdict.nonfinite or verdict.violation}  ({exp})"


def assert_same_optimizer_state(got: dict, want: dict, rtol: float, where: str) -> None:
    violation = optimizer_state_violation(got, want, rtol, where)
    assert violation is None, violation


def run_and_check(pools, exp: Experiment, world_size: int, rtol: float | None = None) -> list[dict]:
    results = pools.run(world_size, run_experiment, exp)
    assert_equivalent(results, reference_of(exp, world_size), exp, rtol)
    return results


__all__ = ["BUCKET_MB", "PRECISION_POLICIES", "stage_options", "experiments",
           "assert_equivalent", "run_and_check", "bit_identical", "replace", "examples"]

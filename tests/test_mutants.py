"""A test earns its place by failing when the code is wrong -- by an assertion, not a crash.

Two kinds of mutants, each one realistic bug (all in ``tests/mutation/``): broken *stages*, which the very
property that passes for the real stage must catch within a few drawn examples; and broken *functions*
anywhere in the package (collectives, ledger, fingerprints, launcher and watchdog, buckets, compression,
layout, sharded optimizer, stages, the loop, the comparison), each with the part of the suite that must fail
while it is in place.  Some are right in value and wrong in cost (bytes, memory, overlap): only a test that
measures the cost catches those.

A catch counts only when a check said no -- an assertion, or the named error the mutant's entry expects (a
stall verdict, say): a mutant that merely makes the code crash is reported as not caught
(:func:`tests.mutation.judge`; the harness's own test is at the end of this file).
"""
from __future__ import annotations

import builtins
import importlib
import os
import traceback

import pytest
from hypothesis import Phase, given, settings

from minizero.comm.fingerprint import CollectiveMismatch
from minizero.run.launch import RankError
from tests.equivalence import experiments, run_and_check
from tests.mutation import STALL, Expected, Mutant, judge, patched, register, try_catch


@pytest.mark.parametrize("mutant", register.STAGE_MUTANTS)
def test_property_suite_catches(pools, mutant):
    @settings(max_examples=40, derandomize=True, database=None, phases=[Phase.generate])
    @given(drawn=experiments(mutant, world_sizes=(2, 3, 4), max_accum=4, stages=register.MUTANT_STAGES))
    def equivalence_property(drawn):
        exp, world_size = drawn
        run_and_check(pools, exp, world_size)

    verdict = try_catch(lambda pools: equivalence_property(), pools)
    _record(mutant, verdict)
    assert verdict.caught, f"{mutant}: {verdict.report()}"


def _record(name: str, verdict) -> None:
    """How each mutant was caught, for the record: ``MINIZERO_MUTANT_LOG=FILE`` appends a line per mutant."""
    if os.environ.get("MINIZERO_MUTANT_LOG"):
        with open(os.environ["MINIZERO_MUTANT_LOG"], "a") as log:
            log.write(f"{name}\t{verdict.how}\n")


def test_tensor_hook_bug_is_right_at_k1_and_caught_at_k2(pools):
    """The classic: syncing in a tensor hook. Passes at K=1, so a suite without accumulation misses it."""
    from minizero.course.harness.experiment import Experiment
    exp = Experiment(stage="ddp-tensor-hook", task="mlp", optimizer="sgd", steps=2, dtype="float64",
                     options={"bucket_mb": 1e-9}, stages=register.MUTANT_STAGES)
    run_and_check(pools, exp, 2)  # K = 1: correct
    from dataclasses import replace
    with pytest.raises(AssertionError):
        run_and_check(pools, replace(exp, accum=2), 2)


def test_ignoring_no_sync_is_right_in_value_and_caught_in_bytes(pools):
    from minizero.course.harness.experiment import Experiment
    exp = Experiment(stage="ddp-ignores-no-sync", task="mlp", steps=2, accum=3, dtype="float64",
                     stages=register.MUTANT_STAGES)
    results = run_and_check(pools, exp, 3)  # the values are right...
    psi = results[0].psi
    assert sum(r.sent_bytes for r in results) == 3 * exp.steps * 2 * 2 * psi * 8  # ...at K = 3 times the bytes


def test_all_reduce_then_all_gather_is_right_in_value_and_caught_in_bytes(pools):
    """The known slip in public ZeRO-1 code: correct parameters, 1.5x the bytes; the ledger test catches it."""
    from minizero.course.harness.experiment import Experiment
    from tests.test_zero import check_zero_bytes
    run_and_check(pools, Experiment(stage="zero1-allreduce-allgather", task="mlp", steps=2, accum=2,
                                    stages=register.MUTANT_STAGES), 3)
    with pytest.raises(AssertionError):
        check_zero_bytes(pools, "zero1-allreduce-allgather", 3, stages=register.MUTANT_STAGES)


@pytest.mark.parametrize("name", list(register.MUTANTS))
def test_the_suite_catches(pools, name):
    """The mutant's catch -- a part of the suite that passes on the real code -- fails with it in place, by an
    assertion or the error its entry expects."""
    mutant = register.MUTANTS[name]
    with pools.patched(name):
        verdict = try_catch(mutant.catch, pools, mutant.expect)
    _record(name, verdict)
    assert verdict.caught, f"{name}: {verdict.report()}"


# ------------------------------------------------------------------------------- the harness itself
def halve(x: int) -> int:
    """The self-test's target: the mutants below replace it."""
    return x // 2


def _halve_checked(pools) -> None:
    assert halve(8) == 4, f"halve(8) is {halve(8)}"


def _raises_in_a_rank(exception: BaseException) -> RankError:
    """The RankError a pool raises for ``exception`` on rank 1: its traceback as text, as it travels back."""
    try:
        raise exception
    except BaseException:  # noqa: BLE001
        text = traceback.format_exc()
    return RankError(f"rank 1 raised:\n{text}", rank=1, remote_traceback=text)


def _mutant(replacement, catch=_halve_checked, expect=()) -> Mutant:
    return Mutant(f"{__name__}:halve", replacement, catch, expect=expect)


def _raise(error: BaseException):
    def replacement(x):
        raise error
    return replacement


#: Python 3.11's, or on 3.10 the backport hypothesis brings.
ExceptionGroup = getattr(builtins, "ExceptionGroup", None) or importlib.import_module("exceptiongroup").ExceptionGroup
MISMATCH = Expected(CollectiveMismatch, "disagree", "the fingerprint check is the detection")


@pytest.mark.parametrize("mutant, caught, how", [
    (_mutant(lambda x: x // 3), True, "assertion"),
    (_mutant(lambda x: x // 2), False, "survived"),
    (_mutant(_raise(TypeError("halve() takes 1 positional argument"))), False, "crashed, not caught: TypeError"),
    (_mutant(_raise(AttributeError("no 'shard'"))), False, "crashed, not caught: AttributeError"),
    (_mutant(_raise(CollectiveMismatch("ranks disagree")), expect=(MISMATCH,)), True, "expected CollectiveMismatch"),
    (_mutant(_raise(CollectiveMismatch("ranks disagree"))), False, "crashed, not caught: minizero.comm.fingerprint"),
    (_mutant(_raise(CollectiveMismatch("other text")), expect=(MISMATCH,)), False, "crashed, not caught"),
    (_mutant(_raise(_raises_in_a_rank(AssertionError("rank 1's parameters differ")))), True, "assertion (rank 1"),
    (_mutant(_raise(_raises_in_a_rank(TypeError("bad signature")))), False, "crashed, not caught: TypeError (rank 1"),
    (_mutant(_raise(_raises_in_a_rank(CollectiveMismatch("ranks disagree"))), expect=(MISMATCH,)), True,
     "expected CollectiveMismatch (rank 1"),
    (_mutant(_raise(RankError("stalled: rank 0 has made no progress"))), False, "crashed, not caught: minizero.run.launch"),
    (_mutant(_raise(RankError("stalled: rank 0 has made no progress")), expect=(STALL,)), True, "expected RankError"),
    (_mutant(_raise(RankError("rank 0 died with exit code -6")), expect=(STALL,)), False, "crashed, not caught"),
    (_mutant(_raise(ExceptionGroup("two", [AssertionError("wrong"), TypeError("crash")]))), False,
     "crashed, not caught: TypeError"),
    (_mutant(_raise(ExceptionGroup("two", [AssertionError("wrong"), AssertionError("also")]))), True, "assertion"),
], ids=["assertion", "survives", "TypeError", "AttributeError", "expected error", "undeclared error",
        "message unmatched", "rank's assertion", "rank's TypeError", "rank's expected error", "undeclared stall",
        "declared stall", "a death is no stall", "group with a crash", "group of assertions"])
def test_the_harness_counts_assertions_and_expected_errors_only(mutant, caught, how):
    """No pools: the mutant, in this process, replaces :func:`halve`; a catch that crashes is not a catch."""
    with patched(mutant):
        verdict = try_catch(mutant.catch, None, mutant.expect)
    assert halve(8) == 4  # taken out again
    assert verdict.caught is caught and verdict.how.startswith(how), verdict.report()
    assert caught or "survived" in verdict.how or "Traceback" in verdict.detail  # a crash comes with its traceback


def test_a_pytest_raises_whose_error_never_came_is_a_catch():
    def catch(pools):
        with pytest.raises(ValueError):
            halve(8)
    assert judge(None).caught is False
    assert try_catch(catch, None).how.startswith("assertion")

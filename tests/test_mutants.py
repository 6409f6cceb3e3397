"""A test earns its place by failing when the code is wrong.

Two kinds of mutants, each one realistic bug: broken *stages* (``mutants.py``),
which the very property that passes for the real stage must catch within a
few drawn examples; and broken *functions* anywhere in the package
(``patch_mutants.py``: collectives, ledger, fingerprints, launcher and
watchdog, buckets, compression, layout, sharded optimizer, stages, the loop,
the comparison), each with the part of the suite that must fail while it is
in place.  Some are right in value and wrong in cost (bytes, memory,
overlap): only a test that measures the cost catches those.
"""
from __future__ import annotations

import os

import pytest
from hypothesis import Phase, given, settings

from tests import mutants, patch_mutants
from tests.equivalence import experiments, run_and_check

VALUE_MUTANTS = sorted({**mutants.MUTANTS, **mutants.HOOK_MUTANTS, **mutants.ZERO_MUTANTS})


@pytest.mark.parametrize("mutant", VALUE_MUTANTS)
def test_property_suite_catches(pools, mutant):
    @settings(max_examples=40, derandomize=True, database=None, phases=[Phase.generate])
    @given(drawn=experiments(mutant, world_sizes=(2, 3, 4), max_accum=4, stages=mutants.MUTANT_STAGES))
    def equivalence_property(drawn):
        exp, world_size = drawn
        run_and_check(pools, exp, world_size)

    with pytest.raises(AssertionError):
        equivalence_property()


def test_tensor_hook_bug_is_right_at_k1_and_caught_at_k2(pools):
    """The classic: syncing in a tensor hook. Passes at K=1, so a suite without accumulation misses it."""
    from minizero.lab.experiment import Experiment
    exp = Experiment(stage="ddp-tensor-hook", task="mlp", optimizer="sgd", steps=2, dtype="float64",
                     options={"bucket_mb": 1e-9}, stages=mutants.MUTANT_STAGES)
    run_and_check(pools, exp, 2)  # K = 1: correct
    from dataclasses import replace
    with pytest.raises(AssertionError):
        run_and_check(pools, replace(exp, accum=2), 2)


def test_ignoring_no_sync_is_right_in_value_and_caught_in_bytes(pools):
    from minizero.lab.experiment import Experiment
    exp = Experiment(stage="ddp-ignores-no-sync", task="mlp", steps=2, accum=3, dtype="float64",
                     stages=mutants.MUTANT_STAGES)
    results = run_and_check(pools, exp, 3)  # the values are right...
    psi = results[0].psi
    assert sum(r.sent_bytes for r in results) == 3 * exp.steps * 2 * 2 * psi * 8  # ...at K = 3 times the bytes


def test_all_reduce_then_all_gather_is_right_in_value_and_caught_in_bytes(pools):
    """The known slip in public ZeRO-1 code: correct parameters, 1.5x the bytes; the ledger test catches it."""
    from minizero.lab.experiment import Experiment
    from tests.test_zero import check_zero_bytes
    run_and_check(pools, Experiment(stage="zero1-allreduce-allgather", task="mlp", steps=2, accum=2,
                                    stages=mutants.MUTANT_STAGES), 3)
    with pytest.raises(AssertionError):
        check_zero_bytes(pools, "zero1-allreduce-allgather", 3, stages=mutants.MUTANT_STAGES)


@pytest.mark.parametrize("name", list(patch_mutants.MUTANTS))
def test_the_suite_catches(pools, name):
    """The mutant's catch -- a part of the suite that passes on the real code -- fails with it in place."""
    catch = patch_mutants.MUTANTS[name].catch
    with pools.patched(name):
        # An assertion, a RankError, a pytest.raises whose error did not come (pytest.fail): caught.
        with pytest.raises((Exception, pytest.fail.Exception)) as info:
            catch(pools)
    if os.environ.get("MINIZERO_MUTANT_LOG"):  # how each was caught, for the record
        with open(os.environ["MINIZERO_MUTANT_LOG"], "a") as log:
            log.write(f"{name}\t{type(info.value).__name__}\t{str(info.value)[:3000]}\n")

"""A test earns its place by failing when the code is wrong.

Each mutant is a DDP with one classic bug; the very property that passes
for ``ddp`` must fail for it, within a few drawn examples.
"""
from __future__ import annotations

import pytest
from hypothesis import Phase, given, settings

import mutants
from equivalence import experiments, run_and_check


VALUE_MUTANTS = sorted({**mutants.MUTANTS, **mutants.HOOK_MUTANTS, **mutants.ZERO_MUTANTS})


@pytest.mark.parametrize("mutant", VALUE_MUTANTS)
def test_property_suite_catches(pools, mutant):
    @settings(max_examples=40, derandomize=True, database=None, phases=[Phase.generate])
    @given(drawn=experiments(mutant, world_sizes=(2, 3, 4), max_accum=4))
    def equivalence_property(drawn):
        exp, world_size = drawn
        run_and_check(pools, exp, world_size)

    with pytest.raises(AssertionError):
        equivalence_property()


def test_tensor_hook_bug_is_right_at_k1_and_caught_at_k2(pools):
    """The classic: syncing in a tensor hook. Passes at K=1, so a suite without accumulation misses it."""
    from minizero.experiment import Experiment
    exp = Experiment(stage="ddp-tensor-hook", task="mlp", optimizer="sgd", steps=2, dtype="float64",
                     options={"bucket_mb": 1e-9})
    run_and_check(pools, exp, 2)  # K = 1: correct
    from dataclasses import replace
    with pytest.raises(AssertionError):
        run_and_check(pools, replace(exp, accum=2), 2)


def test_ignoring_no_sync_is_right_in_value_and_caught_in_bytes(pools):
    from minizero.experiment import Experiment
    exp = Experiment(stage="ddp-ignores-no-sync", task="mlp", steps=2, accum=3, dtype="float64")
    results = run_and_check(pools, exp, 3)  # the values are right...
    psi = results[0]["psi"]
    assert sum(r["sent_bytes"] for r in results) == 3 * exp.steps * 2 * 2 * psi * 8  # ...at K = 3 times the bytes


def test_all_reduce_then_all_gather_is_right_in_value_and_caught_in_bytes(pools):
    """The known slip in public ZeRO-1 code: correct parameters, 1.5x the bytes; the ledger test catches it."""
    from test_zero import check_zero_bytes
    from minizero.experiment import Experiment
    run_and_check(pools, Experiment(stage="zero1-allreduce-allgather", task="mlp", steps=2, accum=2), 3)
    with pytest.raises(AssertionError):
        check_zero_bytes(pools, "zero1-allreduce-allgather", 3)

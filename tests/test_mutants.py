"""A test earns its place by failing when the code is wrong.

Each mutant is a DDP with one classic bug; the very property that passes
for ``ddp`` must fail for it, within a few drawn examples.
"""
from __future__ import annotations

import pytest
from hypothesis import Phase, given, settings

import mutants
from equivalence import experiments, run_and_check


@pytest.mark.parametrize("mutant", sorted(mutants.MUTANTS))
def test_property_suite_catches(pools, mutant):
    @settings(max_examples=40, derandomize=True, database=None, phases=[Phase.generate])
    @given(drawn=experiments(mutant, world_sizes=(2, 3, 4)))
    def equivalence_property(drawn):
        exp, world_size = drawn
        run_and_check(pools, exp, world_size)

    with pytest.raises(AssertionError):
        equivalence_property()

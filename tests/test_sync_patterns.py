"""Backwards inside and outside ``no_sync()`` in every order (issue 45): a step whose K micro-batches synchronise
in any pattern that ends synchronising is single-device training's step -- the gradients of two synchronising
backwards add, as ``.grad`` does, on every stage.  (torch's idiom, the last micro-batch alone synchronising, is
what every other property draws; the labs draw these patterns too, and a ZeRO-2 that sets a piece's ``.grad``
instead of adding to it passes every other property.)"""
from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from minizero.course.harness.experiment import Experiment
from minizero.run.train import Step, train_step
from tests.equivalence import examples, experiments, run_and_check

#: The stages whose backward synchronises (local-sgd and ps-async are other algorithms: they have their own).
STAGES = ("ddp", "ddp-bucketed", "zero1", "zero2", "zero3", "zeropp", "hsdp", "ps")


@pytest.mark.parametrize("stage", STAGES)
@settings(max_examples=examples(4))
@given(data=st.data())
def test_any_order_of_synchronising_backwards_is_one_device_training(pools, stage, data):
    """Drawn as the suite draws (world sizes 1-4, models, batches, optimizers), with a pattern every time."""
    exp, world_size = data.draw(experiments(stage, max_accum=3, syncs=True).filter(lambda d: d[0].syncs is not None))
    run_and_check(pools, exp, world_size)


@pytest.mark.parametrize("pattern", [(True, True), (True, False, True), (False, True, True), (True, True, True)])
@pytest.mark.parametrize("stage", STAGES)
def test_each_pattern_explicitly(pools, stage, pattern):
    """Every order at K <= 3, on the edge model (frozen, unused, tied parameters) at N = 3: named, not hoped for."""
    exp = Experiment(stage=stage, task="edge", optimizer="momentum", lr=0.05, steps=2, accum=len(pattern),
                     dtype="float64", syncs=pattern, options={"find_unused_parameters": True})
    run_and_check(pools, exp, 3)


def test_a_pattern_must_end_synchronising():
    with pytest.raises(ValueError, match=r"syncs=\(True, False\): one per micro-batch \(2\), the last True"):
        train_step(None, Step([(None, None)] * 2, 1), syncs=(True, False))
    with pytest.raises(ValueError, match=r"one per micro-batch \(3\)"):
        train_step(None, Step([(None, None)] * 3, 1), syncs=(True, True))

"""Stage ``ddp`` is single-device training, step for step.

The property suite draws world size 1-4, model shape, per-rank batch sizes
(equal or not), accumulation steps, optimizer, learning rate, steps, seed,
dtype and backend, and checks every parameter on every rank after every step.
"""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from minizero.course.harness.equivalence import bit_identical
from minizero.course.harness.experiment import Experiment, reference_of, run_experiment
from tests.equivalence import covering, examples, experiments, run_and_check


@covering
@settings(max_examples=examples(30))
@given(drawn=experiments("ddp", max_accum=4, wrap_first=True))
def test_ddp_matches_reference(pools, drawn):
    exp, world_size = drawn
    run_and_check(pools, exp, world_size)


@settings(max_examples=examples(12))
@given(world_size=st.sampled_from([1, 2, 4]), k=st.sampled_from([1, 2, 4]), mb=st.sampled_from([1, 2, 4]),
       steps=st.integers(1, 3), seed=st.integers(0, 1000), backend=st.sampled_from(["ring", "native"]),
       sizes=st.sampled_from([(4, 2), (5, 1), (3, 4)]))
def test_ddp_dyadic_is_bit_identical(pools, world_size, k, mb, steps, seed, backend, sizes):
    """Multiples of 1/8, SGD with lr 1/4, powers of two for N, K and batch: every
    sum is exact, so summation order cannot matter and the bits must agree.
    (Output widths are powers of two too: the loss is divided by the number
    of loss terms, samples x outputs.)"""
    exp = Experiment(stage="ddp", task="dyadic", model={"sizes": sizes}, optimizer="sgd", lr=0.25, steps=steps,
                     micro_batch=mb, accum=k, dtype="float64", seed=seed, backend=backend)
    results = pools.run(world_size, run_experiment, exp)
    assert bit_identical(results, reference_of(exp, world_size))


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
@pytest.mark.parametrize("optimizer", ["momentum", "adamw"])
def test_edge_parameters(pools, world_size, optimizer):
    """Frozen, requires_grad=False, unused, tied and zero-size parameters, with accumulation."""
    exp = Experiment(stage="ddp", task="edge", optimizer=optimizer, lr=0.05, steps=3, accum=2, dtype="float64",
                     options={"find_unused_parameters": True})
    results = run_and_check(pools, exp, world_size)
    last = results[0].params[-1]
    assert torch.equal(last["unused"], torch.ones(5)), "a parameter without gradient must not move"


@pytest.mark.parametrize("world_size", [2, 3])
def test_gpt_with_tied_embedding(pools, world_size):
    run_and_check(pools, Experiment(stage="ddp", task="gpt", steps=3, accum=2, dtype="float64"), world_size)


def test_ddp_syncs_once_per_optimizer_step_under_accumulation(pools):
    """K micro-batches, one all-reduce: the ledger sees exactly one step's worth of bytes."""
    exp = Experiment(stage="ddp", task="mlp", steps=2, accum=4, dtype="float64")
    results = pools.run(3, run_experiment, exp)
    psi = results[0].psi
    assert sum(r.sent_bytes for r in results) == exp.steps * 2 * (3 - 1) * psi * 8

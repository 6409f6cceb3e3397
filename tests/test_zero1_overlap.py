"""ZeRO-1 with ``overlap`` (DeepSpeed stage 1's ``overlap_comm``): each bucket's reduce-scatter leaves during
backward, in place, and the full gradients stay.  The same training as single-device, the same bytes and the same
memory as the paper's ZeRO-1 -- only where the wait falls changes, which the cost model and the dialled wire show."""
from __future__ import annotations

from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from minizero.comm.network import parse_network
from minizero.costs.cost_model import StepPlan, predict
from minizero.course.harness.costs import bytes_problem, memory_problem, overlap_problem
from minizero.course.harness.experiment import Experiment, run_experiment
from minizero.course.harness.overlap import backward_launches
from minizero.stages import STAGES
from tests.equivalence import examples, experiments, run_and_check


def overlapping(drawn):
    exp, world_size = drawn
    return replace(exp, options={**exp.options, "overlap": True}), world_size


def on_the_ring(drawn):
    """16-bit sums are compared with a reference that adds in the send/recv ring's order; gloo's reduce-scatter adds
    in its own, and at N >= 3 with small buckets a last bit can differ (seen on zero1 and zero2 alike, overlap or
    not: a blind spot of the suite's drawn native-backend examples, noted on issue 46)."""
    exp, world_size = drawn
    return replace(exp, backend="ring"), world_size


@settings(max_examples=examples(20))
@given(drawn=st.one_of(experiments("zero1", max_accum=3, wrap_first=True),
                       experiments("zero1", max_accum=2, precision=True).map(on_the_ring)).map(overlapping))
def test_zero1_with_overlap_matches_the_reference(pools, drawn):
    """World sizes 1-4, K up to 3, uneven batches, drawn bucket sizes (one parameter per bucket to one bucket),
    frozen, tied and unused parameters, clipping, two param groups, mixed precision, the optimizer built after
    wrapping."""
    exp, world_size = drawn
    run_and_check(pools, exp, world_size)


@pytest.mark.parametrize("task, model", [("routed", {}), ("edge", {})])
@pytest.mark.parametrize("bucket_mb", [25.0, 2e-4])
def test_a_bucket_some_parameter_never_completes_is_reduced_after_backward(pools, task, model, bucket_mb):
    """A parameter no micro-batch of the synchronising backward used (routed away, or never used) leaves its bucket
    incomplete: it must still be reduced once backward ends, with the rest of its bucket."""
    exp = Experiment(stage="zero1", task=task, model=model, optimizer="adam", steps=3, accum=2, dtype="float64",
                     record_states=True, options={"overlap": True, "bucket_mb": bucket_mb, "find_unused_parameters": True})
    run_and_check(pools, exp, 3)


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_overlap_sends_and_holds_what_zero1_does(pools, world_size):
    exp = Experiment(stage="zero1", task="gpt", steps=2, accum=2, dtype="float32", optimizer="adamw",
                     options={"overlap": True, "bucket_mb": 1e-3})
    results = pools.run(world_size, run_experiment, exp)
    psi = results[0].psi
    sent = STAGES["zero1"].sent_bytes_per_step(psi, world_size, 4, 4)
    padding = 2 * (world_size - 1) * 4 * 60  # < N elements per bucket, each way
    assert sent <= sum(r.sent_bytes for r in results) / (world_size * exp.steps) <= sent + padding
    assert bytes_problem(results, sent, {"reduce_scatter", "all_gather"}, rel=padding / sent) is None
    assert memory_problem(results, STAGES["zero1"].state_bytes(psi, world_size, 4, 2)) is None


def test_the_reduce_scatters_leave_during_backward(pools):
    """Overlapped, each bucket's reduce-scatter is handed to the communication thread while gradients are still to
    come, and none runs on the main thread during backward; without overlap none leaves before backward ends.

    Judged by when the main thread *submits* (:func:`~minizero.course.harness.overlap.backward_launches`, the
    labs' checker's definition), not by when the communication thread starts: on two cores at load, that thread
    may not be scheduled until backward has ended (0 of 9 started during it, seen once in CI) -- a fact about the
    machine, where the submission is the stage's."""
    exp = Experiment(stage="zero1", task="gpt", model={"n_layer": 4}, steps=2, dtype="float32", optimizer="sgd",
                     check=False, options={"bucket_mb": 0.03})
    for world_size in (2, 3):
        overlapped = pools.run(world_size, backward_launches, replace(exp, options={**exp.options, "overlap": True}))
        assert overlap_problem(overlapped, exp.steps) is None
        assert all(len(b["launches"]) >= 3 for backwards in overlapped for b in backwards), overlapped
        serial = pools.run(world_size, backward_launches, exp)
        assert "no bucket left while backward still had gradients" in overlap_problem(serial, exp.steps)


def test_the_cost_model_hides_the_overlapped_reduce_scatters():
    plan = StepPlan(2, parse_network("alpha=1ms,bandwidth=100MB/s"), 0.05, 0.1, (0.0, 2e6, 2e6, 2e6))
    paper = predict(STAGES["zero1"], plan)
    overlapped = predict(STAGES["zero1"], replace(plan, options={"overlap": True, "bucket_mb": 8.0}))
    assert overlapped.comm_s == pytest.approx(paper.comm_s + 4 * 1e-3, rel=1e-9)  # 3 buckets: 2 more alphas each way
    assert overlapped.step_s < paper.step_s - 0.05  # most of the reduce-scatter hides behind backward

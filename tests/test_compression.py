"""Gradient compression: half the bytes, the same casts as the reference, errors reported."""
from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from minizero.comm import ReduceOp, make_comm
from minizero.compress import split_division
from minizero.compress.sixteen_bit import Wire
from minizero.course.harness.equivalence import bit_identical, max_diff
from minizero.course.harness.experiment import Experiment, exact_reference_of, reference_of, run_experiment
from minizero.course.harness.models import MLP
from minizero.run.launch import RankError
from minizero.stages import make_stage
from tests.equivalence import WORLD_SIZES, covering, covering_every_world_size, examples, experiments, run_and_check


# Every stage at every world size, not drawn: the parametrizations of one test share hypothesis's seed, so a
# drawn world size comes out alike for every stage -- 25 examples of zero3 never drew 3 ranks.
@pytest.mark.parametrize("world_size", WORLD_SIZES)
@pytest.mark.parametrize("stage", ["ddp", "ddp-bucketed", "zero1", "zero2", "zero3"])
@covering_every_world_size
@settings(max_examples=examples(3))
@given(data=st.data())
def test_compressed_stage_matches_the_same_casts_reference(pools, stage, world_size, data):
    """Bit for bit in practice (the same casts, the ring's summation order); and exactly half
    the gradient bytes of the uncompressed formula."""
    exp, world_size = data.draw(experiments(stage, world_sizes=(world_size,), compress=True, backends=("ring",),
                                            max_accum=3))
    results = run_and_check(pools, exp, world_size)
    psi = results[0].psi
    if stage.startswith("ddp") and exp.task != "edge":  # edge's unused parameter sends nothing in plain ddp
        assert sum(r.sent_bytes for r in results) == exp.steps * 2 * (world_size - 1) * psi * 2


@pytest.mark.parametrize("stage", ["ddp", "ddp-bucketed", "zero2"])
@pytest.mark.parametrize("compress", ["fp16", "bf16"])
def test_compressed_bytes_are_half(pools, stage, compress):
    """Gradients cross the wire in 16 bits: exactly half of their bytes (the ledger, not the formula)."""
    exp = Experiment(stage=stage, task="mlp", steps=2, dtype="float32", options={"compress": compress})
    plain, half = (sum(r.sent_bytes for r in pools.run(3, run_experiment, e))
                   for e in (replace(exp, options={}), exp))
    gradient_share = 0.5 if stage == "zero2" else 1.0  # ZeRO all-gathers parameters, in their own precision
    # and its ranks, each holding only its shard of the sum, agree on inf/NaN once a step (compress.overflow)
    flag = exp.steps * 3 * 2 * (3 - 1) * 4 if stage == "zero2" else 0  # per rank: 3 floats all-reduced, 2(N-1)/N
    assert half == plain * (1 - gradient_share / 2) + flag


@covering
@settings(max_examples=examples(8))
@given(drawn=experiments("ddp-bucketed", compress=True, backends=("native",)))
def test_compressed_native_is_close_to_the_same_casts_reference(pools, drawn):
    """gloo sums 16-bit chunks in its own order; a few 16-bit roundings apart at most."""
    exp, world_size = drawn
    results = pools.run(world_size, run_experiment, exp)
    abs_diff, rel = max_diff(results, reference_of(exp, world_size))
    assert rel <= 2e-2, rel


@pytest.mark.parametrize("stage", ["ddp", "ddp-bucketed"])
@pytest.mark.parametrize("compress", ["fp16", "bf16"])
@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_lossless_casts_give_exact_training(pools, stage, compress, world_size):
    """Dyadic gradients with few significant bits survive 16 bits unchanged, and dividing by
    powers of two is exact: the compressed run must equal *exact* training bit for bit."""
    exp = Experiment(stage=stage, task="dyadic", model={"sizes": (2, 2)}, optimizer="sgd", lr=0.25, steps=1,
                     micro_batch=1, dtype="float64", options={"compress": compress})
    results = pools.run(world_size, run_experiment, exp)
    assert bit_identical(results, exact_reference_of(exp, world_size))


def test_compression_changes_results_only_slightly(pools):
    """The measured bound against exact training, for the record (compare prints it as 'vs exact')."""
    exp = Experiment(stage="ddp-bucketed", task="gpt", optimizer="adamw", steps=3, dtype="float32",
                     options={"compress": "fp16"})
    results = pools.run(3, run_experiment, exp)
    _, rel = max_diff(results, exact_reference_of(exp, 3))
    assert 0 < rel < 1e-2


@pytest.mark.parametrize("n, pre, post", [(1, 1, 1), (2, 1, 2), (3, 1, 3), (4, 2, 2), (8, 2, 4), (16, 4, 4), (64, 8, 8)])
def test_division_split_is_a_power_of_two_near_sqrt_n(n, pre, post):
    assert split_division(n) == (pre, post)


def _overflow(me, compress):
    model = MLP((4, 4), seed=0)
    stage = make_stage("ddp", model, torch.optim.SGD(model.parameters(), lr=0.1), make_comm("ring"), compress=compress)
    before = [p.detach().clone() for p in model.parameters()]
    loss = (stage(torch.ones(2, 4)) * 1e5).sum()
    try:
        loss.backward()
        stage.step()
    except FloatingPointError as error:
        return str(error), all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
    return None, None


def test_fp16_overflow_is_reported_and_weights_untouched(pools):
    for message, untouched in pools.run(2, _overflow, "fp16"):
        assert message is not None and "overflowed torch.float16" in message and "compress='bf16'" in message
        assert untouched


def test_bf16_has_the_range_fp16_lacks(pools):
    assert pools.run(2, _overflow, "bf16") == [(None, None), (None, None)]


def _compress_fp16_parameters(me):
    model = MLP((4, 4), seed=0).half()
    make_stage("ddp", model, torch.optim.SGD(model.parameters(), lr=0.1), make_comm("ring"), compress="fp16")


def test_compression_on_16_bit_gradients_is_refused(pools):
    with pytest.raises(RankError, match="only makes sense for float32/float64 gradients; parameter 'layers.0.weight'"):
        pools.run(2, _compress_fp16_parameters)


def test_unknown_compression_is_refused():
    from minizero.compress import check_compress
    with pytest.raises(ValueError, match="compress must be one of none, fp16, bf16") as refused:
        check_compress("int16")
    assert "got 'int16'" in str(refused.value)
    check_compress("int8")  # a codec: accepted


def _finite_on_every_rank_infinite_summed(me):
    comm = make_comm("ring")
    try:
        flat = torch.full((5,), 30000.0)  # fp16 holds 30000 (it tops out at 65504); three of them summed, it does not
        assert torch.isfinite(flat.to(torch.float16)).all()
        try:
            comm.all_reduce(flat, ReduceOp.AVG, wire=Wire(comm, torch.float16))
        except FloatingPointError as error:
            return str(error), torch.equal(flat, torch.full((5,), 30000.0))
        return None, None
    finally:
        comm.close()


def test_an_overflow_that_exists_only_in_the_sum_is_refused(pools):
    """Every rank's gradient is finite in fp16 and their sum is not (N = 3: pre = 1, the whole division after the
    sum): a check of each rank's own values before the reduction passes it; the wire's, on the sum, refuses it on
    every rank and writes nothing into the gradient."""
    for message, untouched in pools.run(3, _finite_on_every_rank_infinite_summed):
        assert message is not None and "overflowed torch.float16 in the reduction" in message, message
        assert untouched

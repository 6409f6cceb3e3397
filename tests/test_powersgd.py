"""PowerSGD (``compress="powersgd:rank=R"``): its own promises on one process -- which tensors it compresses,
orthonormal factors, an exactly low-rank mean recovered exactly, error feedback that loses nothing -- then
every stage it fits against the reference that runs the same steps on the same per-rank buffers, with the
ledger's bytes equal to (n + m) r per matrix.  torch's own ``powerSGD_hook`` is the oracle in test_oracle.py."""
from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from minizero.compress import parse
from minizero.compress.powersgd import PowerSGD, PowerState, orthogonalize, power_step
from minizero.compress.powersgd_layout import lay_out
from minizero.course.harness.casts_reference import powersgd_average, ring_sum
from minizero.course.harness.experiment import Experiment
from tests.equivalence import covering_every_world_size, examples, experiments, run_and_check
from tests.test_codecs import _refusal


def test_only_matrices_worth_it_are_compressed_grouped_by_shape():
    """torch's rule: (n + m) r * min_rate < n m; vectors, scalars and empty tensors travel as they are.
    Matrices are grouped by shape in first-seen order (torch's order: its random Q lands on the same ones)."""
    layout = lay_out([("a", torch.Size([16, 8])), ("bias", torch.Size([16])), ("b", torch.Size([4, 16])),
                      ("c", torch.Size([16, 2, 4])), ("small", torch.Size([3, 3])), ("empty", torch.Size([0, 5])),
                      ("scalar", torch.Size([]))], PowerSGD(rank=1))
    assert [(m.name, m.n, m.m, m.r) for m in layout.matrices] == [("a", 16, 8, 1), ("c", 16, 8, 1), ("b", 4, 16, 1)]
    assert [m.offset for m in layout.matrices] == [0, 208, 144]
    assert layout.rest == [(128, 16), (336, 9), (345, 0), (345, 1)]
    assert (layout.p_size, layout.q_size) == (16 + 16 + 4, 8 + 8 + 16)
    assert lay_out([("b", torch.Size([4, 16]))], PowerSGD(rank=2)).matrices == []  # (4 + 16) 2 2 = 80 > 64


@pytest.mark.parametrize("r", [1, 2, 3, 5])
def test_orthogonalize_makes_orthonormal_columns(r):
    """Gram-Schmidt for r <= 2 and QR above (torch's split): either way P^T P = I."""
    columns = torch.randn(12, r, dtype=torch.float64, generator=torch.Generator().manual_seed(r))
    orthogonalize(columns, 0.0, "test")
    assert torch.allclose(columns.t() @ columns, torch.eye(r, dtype=torch.float64), atol=1e-12)


def test_a_zero_column_is_refused_naming_the_matrix_unless_epsilon():
    columns = torch.zeros(5, 2, dtype=torch.float64)
    with pytest.raises(FloatingPointError, match="layer.weight.*epsilon=1e-8"):
        orthogonalize(columns, 0.0, "rank 0: P of layer.weight")
    orthogonalize(columns, 1e-8, "rank 0: P of layer.weight")
    assert torch.equal(columns, torch.zeros(5, 2, dtype=torch.float64))  # no direction, no NaN


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
@pytest.mark.parametrize("r", [1, 2, 3])
def test_an_exactly_low_rank_mean_is_recovered_in_one_step(world_size, r):
    """If every rank's matrix lies in one r-dimensional column space, P spans it after one power step and
    P P^T M = M: the mean comes back to round-off.  A Q not divided by N, a P not orthogonalized, or a rank's
    own matrix sent in place of the sum would each miss it by far more."""
    g = torch.Generator().manual_seed(world_size * 10 + r)
    basis = torch.randn(10, r, dtype=torch.float64, generator=g)
    grads = [(basis @ torch.randn(r, 7, dtype=torch.float64, generator=g)).reshape(-1) for _ in range(world_size)]
    settings_ = PowerSGD(rank=r, min_rate=1)
    layout = lay_out([("w", torch.Size([10, 7]))], settings_)
    q = PowerState(settings_).starting_q("w", layout, torch.float64, "cpu", "test")
    mean, _ = power_step(grads, layout, q, ring_sum, world_size, 0.0, "test")
    assert torch.allclose(mean, sum(grads) / world_size, rtol=0, atol=1e-12)


def test_a_full_rank_mean_is_not_recovered_so_the_test_above_can_fail():
    g = torch.Generator().manual_seed(0)
    grads = [torch.randn(70, dtype=torch.float64, generator=g) for _ in range(2)]
    layout = lay_out([("w", torch.Size([10, 7]))], PowerSGD(rank=1, min_rate=1))
    q = PowerState(PowerSGD(rank=1)).starting_q("w", layout, torch.float64, "cpu", "test")
    mean, _ = power_step(grads, layout, q, ring_sum, 2, 0.0, "test")
    assert (mean - sum(grads) / 2).abs().max() > 0.1


@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("warm_start", [True, False])
def test_error_feedback_loses_nothing_it_only_delivers_it_later(world_size, warm_start):
    """Over any number of steps, what was applied plus the ranks' mean residual is the sum of the mean
    gradients: the residual is measured against the mean's approximation (the paper's and torch's choice),
    so averaged over ranks it is exactly what the mean has not yet received -- including the tensors sent
    uncompressed (each rank's residual there is its gradient minus the mean; they cancel on average)."""
    g = torch.Generator().manual_seed(world_size)
    shapes = [("w", torch.Size([12, 9])), ("b", torch.Size([12]))]
    state, residuals = PowerState(PowerSGD(rank=1, warm_start=warm_start)), {}
    applied = given_total = torch.zeros(120, dtype=torch.float64)
    for _ in range(6):
        flats = [torch.randn(120, dtype=torch.float64, generator=g) for _ in range(world_size)]
        applied = applied + powersgd_average(state, 0, flats, shapes, residuals)
        given_total = given_total + sum(flats) / world_size
    mean_residual = sum(residuals[(r, 0)] for r in range(world_size)) / world_size
    assert torch.allclose(applied + mean_residual, given_total, rtol=0, atol=1e-12)
    assert mean_residual.abs().max() > 0.1  # rank 1 of a random 12 x 9: lossy, or this proved nothing


def test_warm_start_draws_one_seed_per_buffer_and_then_reuses_q():
    """torch's generator of seeds: one draw per buffer when its Q is fresh -- every step without warm start,
    once with it; a buffer with no matrix draws too (torch allocates its empty Q there)."""
    layout = lay_out([("w", torch.Size([12, 9]))], PowerSGD(rank=1))
    warm, cold = PowerState(PowerSGD(rank=1)), PowerState(PowerSGD(rank=1, warm_start=False))
    for state in (warm, cold):
        for _ in range(3):
            q = state.starting_q("w", layout, torch.float64, "cpu", "test")
            state.keep("w", q)
    assert (warm.draws, cold.draws) == (1, 3)


@pytest.mark.parametrize("spec, message", [
    ("powersgd:rank=0", "rank must be >= 1"), ("powersgd:start=-1", "start >= 0"),
    ("powersgd:rnak=2", "unknown setting 'rnak'"), ("powersgd:rank=two", "rank='two' is not a int"),
])
def test_bad_settings_are_refused_saying_which(spec, message):
    with pytest.raises(ValueError, match=message):
        parse(spec)


def test_the_spec_names_every_setting_and_builds_the_same_settings():
    settings_ = parse("powersgd:2,warm_start=0,epsilon=1e-8")
    assert settings_ == PowerSGD(rank=2, warm_start=False, epsilon=1e-8)
    assert parse(settings_.spec()) == settings_


@pytest.mark.parametrize("stage", ["zero1", "zero2", "zero3", "ps"])
def test_stages_that_reduce_scatter_refuse_powersgd_in_one_line(pools, stage):
    text = pools.run(2, _refusal, stage, "powersgd:rank=2")[0]
    assert text and "\n" not in text and "P and Q" in text and ("reduce_scatter" in text or "push" in text) \
        and "fp16" in text


SPECS = ["powersgd:rank=1", "powersgd:rank=2,warm_start=0", "powersgd:rank=3,min_rate=1", "powersgd:rank=1,start=1"]


@pytest.mark.parametrize("world_size", (1, 2, 3, 4))
@pytest.mark.parametrize("stage", ["ddp", "ddp-bucketed"])
@covering_every_world_size
@settings(max_examples=examples(3))
@given(data=st.data())
def test_powersgd_stage_matches_the_same_steps_reference_and_its_byte_formula(pools, stage, world_size, data):
    """The same PowerSGD steps on the same per-rank buffers -- the same matrices, Q, residuals, all-reduces
    in the ring's order: equal at the suite's tight tolerance.  And the ledger's all-reduce bytes are the
    formula: per buffer the rest, then n r and m r per matrix, each all-reduced (2(N-1)/N of its bytes).
    (``compress=True`` draws the 16-bit wire's experiments; the spec drawn here replaces its wire.)"""
    exp, world_size = data.draw(experiments(stage, world_sizes=(world_size,), compress=True, max_accum=3))
    exp = replace(exp, options={**exp.options, "compress": data.draw(st.sampled_from(SPECS))})
    results = run_and_check(pools, exp, world_size)
    if exp.options.get("find_unused_parameters"):
        return  # (its bitmap is an all-reduce too)
    # (a ring's chunks are uneven when N does not divide the buffer: the formula holds for the mean over ranks)
    mean = sum(r.sent_by_kind.get("all_reduce", 0) for r in results) / world_size
    assert mean == pytest.approx(exp.steps * results[0].wire_sent_bytes_per_step)


@pytest.mark.parametrize("stage", ["ddp", "ddp-bucketed"])
@pytest.mark.parametrize("world_size", [2, 3])
def test_powersgd_on_a_gpt_matches_its_reference(pools, stage, world_size):
    """A fixed case beside the drawn ones: a GPT (ten matrices), error feedback, K = 2, three buckets."""
    exp = Experiment(stage=stage, task="gpt", optimizer="adamw", steps=4, accum=2, dtype="float64",
                     options={"compress": "powersgd:rank=2", "error_feedback": True,
                              **({"bucket_mb": 0.01} if stage == "ddp-bucketed" else {})})
    run_and_check(pools, exp, world_size)


def test_sixteen_bit_columns_are_orthogonalized_by_gram_schmidt_even_above_rank_two():
    """torch's QR has no 16-bit kernel; torch's hook then uses Gram-Schmidt, and so does this one."""
    columns = torch.randn(16, 4, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    orthogonalize(columns, 0.0, "test")
    gram = columns.float().t() @ columns.float()
    assert torch.allclose(gram, torch.eye(4), atol=5e-2)


def _misused(me, what):
    from minizero.comm import ReduceOp, make_comm
    from minizero.compress.gathered import GatheredWire
    comm = make_comm("ring")
    wire = GatheredWire(comm, parse("int8"))
    try:
        if what == "not contiguous":
            comm.all_reduce(torch.ones(4, 3).t(), ReduceOp.AVG, wire=wire, key=0)
        else:
            comm.reduce_scatter(torch.empty(2), torch.ones(5), ReduceOp.AVG, wire=wire, key=0)
    except ValueError as refused:
        return str(refused)
    finally:
        comm.close()
    return None


@pytest.mark.parametrize("what, words", [("not contiguous", "must be contiguous"),
                                          ("not N shards", "pad the full tensor to a multiple of world_size")])
def test_a_wire_that_runs_its_own_collectives_refuses_what_a_collective_refuses(pools, what, words):
    """Its collectives see only the copies it makes: a strided tensor would be averaged into a copy and lost, a
    tail beyond N shards dropped -- both refused first, as without a wire."""
    text = pools.run(2, _misused, what)[0]
    assert text and words in text

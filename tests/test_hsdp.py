"""HSDP (:mod:`minizero.stages.hsdp`): equivalent to single-device training on every drawn node shape -- one node
(ZeRO-3), one rank per node (DDP of whole shards), and between -- with ZeRO-3's every option; its bytes per link
class and its memory beside their formulas; checkpoints that resume and reshard across node shapes."""
from __future__ import annotations

from dataclasses import replace

import pytest
from hypothesis import given, settings

from minizero.lab.compare import compare
from minizero.lab.experiment import Experiment
from tests.equivalence import covering, examples, experiments, run_and_check


@covering
@settings(max_examples=examples(24))
@given(drawn=experiments("hsdp", max_accum=3))
def test_hsdp_matches_reference(pools, drawn):
    exp, world_size = drawn
    run_and_check(pools, exp, world_size)


@covering
@settings(max_examples=examples(24))
@given(drawn=experiments("zero3", nodes=True, world_sizes=(2, 3, 4)))
def test_zero3_on_drawn_nodes_and_the_hierarchical_backend(pools, drawn):
    exp, world_size = drawn
    run_and_check(pools, exp, world_size)


@covering
@settings(max_examples=examples(16))
@given(drawn=experiments("ddp-bucketed", nodes=True, world_sizes=(2, 3, 4)))
def test_bucketed_ddp_on_drawn_nodes_and_the_hierarchical_backend(pools, drawn):
    exp, world_size = drawn
    run_and_check(pools, exp, world_size)


@pytest.mark.parametrize("shape", ["2x2", "1x4", "4x1", "1x3", "3x1", "2x1"])
@pytest.mark.parametrize("backend", ["ring", "hierarchical"])
def test_bytes_per_link_and_memory_beside_their_formulas(shape, backend):
    """compare's own rows: every link class's bytes within 2% of the formula, model states 16Ψ/G."""
    m, g = map(int, shape.split("x"))
    exp = Experiment(task="gpt", steps=2, network=f"nodes={shape}", backend=backend)
    rows = compare(m * g, ["hsdp", "zero3"], exp, timeout_s=120)
    for row in rows:
        assert row.within_tolerance and row.bytes_match and row.memory_match, row
        assert row.links_match, (row.stage, row.intra_bytes_per_step, row.intra_bytes_formula,
                                 row.inter_bytes_per_step, row.inter_bytes_formula)
    hsdp, zero3 = rows
    if m > 1 and g > 1:  # the point: less through the slow link, for more memory.  At 2 x 2 per rank: HSDP's
        # 2(M-1)/M x Psi/G = 0.5 Psi against flat ZeRO-3's 3(N-1)/N x Psi x M/N = 1.125 Psi (4/9), and against
        # hierarchical ZeRO-3's 3(M-1)/(M G) x Psi = 0.75 Psi (2/3)
        assert hsdp.inter_bytes_per_step < zero3.inter_bytes_per_step * (0.45 if backend == "ring" else 0.67)
        assert hsdp.state_bytes > zero3.state_bytes


def _with_hpz(drawn):
    exp, world_size = drawn
    return replace(exp, options={**exp.options, "hpz": True}), world_size


@settings(max_examples=examples(10))
@given(drawn=experiments("zero3", nodes=True, world_sizes=(2, 4)).map(_with_hpz))
def test_zero3_with_hpz_matches_reference(pools, drawn):
    """hpZ in every draw, on drawn nodes (one rank per node included: then it changes nothing)."""
    exp, world_size = drawn
    run_and_check(pools, exp, world_size)


@pytest.mark.parametrize("shape", ["2x2", "1x3", "4x1"])
def test_hpz_keeps_the_backward_gather_inside_the_node(shape):
    """ZeRO++'s hpZ on zero3: the same training; the backward gather's bytes move from the slow link to the fast
    one (2 x 2: inter-node bytes 2/3 of ZeRO-3's), for a working set larger by the node-local slices."""
    m, g = map(int, shape.split("x"))
    exp = Experiment(task="gpt", steps=2, network=f"nodes={shape}")
    plain, hpz = (compare(m * g, ["zero3"], exp, timeout_s=120, **options)[0] for options in ({}, {"hpz": True}))
    for row in (plain, hpz):
        assert row.within_tolerance and row.bytes_match and row.links_match, row
    if m > 1:
        assert hpz.inter_bytes_per_step == pytest.approx(plain.inter_bytes_per_step * 2 / 3, rel=0.02)
    if g > 1:
        assert hpz.gathered_peak_bytes > plain.gathered_peak_bytes
    assert hpz.sent_bytes_per_step <= plain.sent_bytes_per_step

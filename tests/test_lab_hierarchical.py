"""The hierarchical lab: the verdicts' words on hand-made numbers (a wrong column, a wrong divisor, the flat ring's
links), blank skeletons failing by name, the answer keys passing, and every known mistake failing on the property it
breaks -- the values, or the bytes on the slow link -- and named.  (``tests/test_labs.py`` runs both levels'
skeletons and answer keys as for every lab; ``tests/test_lab_mistakes.py`` the planted mistakes.)"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from minizero.comm import INTER, INTRA, Nodes, ReduceOp
from minizero.comm.hierarchical import link_bytes_sent
from minizero.course.labs import check, skeleton_path
from minizero.course.labs import mistakes_hierarchical as known
from minizero.course.labs.properties_hierarchical import OPS, contribution, links_problem, reduction, wrong_value

SOLUTIONS = Path(__file__).parent / "lab_solutions"
RESULTS = "every all-reduce's result on every node shape: the flat ring's"
LINKS = "bytes per rank on each link class: the two-level all-reduce's"
#: What each known mistake fails, and words its verdict must say beyond the mistake's own sentence.
FAILS = {known.DividesByNodeSize: (RESULTS, "divided by"), known.SkipsTheAcrossPhase: (RESULTS, "never entered it"),
         known.GathersBeforeAcross: (RESULTS, "gather last"), known.DividesAtBothLevels: (RESULTS, "N twice"),
         known.AveragesAcrossToo: (RESULTS, "N and again M"),
         known.FlatRingAllReduce: (LINKS, "exactly the flat ring's bytes"),
         known.AcrossTheWholeTensor: (LINKS, "whole tensor's")}


def quiet(_):
    pass


def rounds_of(results: list[dict[str, torch.Tensor]], links=None) -> list[dict]:
    """Every rank's round as :func:`~minizero.course.labs.properties_hierarchical.all_reduce_round` returns it."""
    return [{op.name: {"got": r[op.name], "links": (links or [{}] * len(results))[q]} for op in OPS}
            for q, r in enumerate(results)]


def correct(shape, numel, dtype="float64", seed=0) -> list[dict[str, torch.Tensor]]:
    n = Nodes(*shape).world_size
    inputs = [contribution(q, numel, dtype, seed) for q in range(n)]
    return [{op.name: reduction(inputs, op, n) for op in OPS} for _ in range(n)]


def test_a_wrong_value_names_the_rank_the_shape_the_op_the_element_and_what_it_looks_like():
    shape, numel = (2, 2), 6
    assert wrong_value(rounds_of(correct(shape, numel)), shape, numel, "float64", 0) is None
    inputs = [contribution(q, numel, "float64", 0) for q in range(4)]
    halved = correct(shape, numel)
    halved[3]["AVG"] = reduction(inputs, ReduceOp.SUM, 1) / 2  # divided by G = M = 2: the numbers cannot tell which
    said = wrong_value(rounds_of(halved), shape, numel, "float64", 0)
    assert said.startswith("all_reduce AVG on rank 3 (node 1, place 1; 2 nodes x 2 ranks): element 0 is "), said
    assert "divided by 2 (G = 2, the ranks of a node; or M = 2, the nodes" in said and "should be" in said, said
    gathered_early = correct(shape, numel)  # columns [0, 3) and [3, 6): each rank's own right, the other its node's
    for q in range(4):
        node_sum = reduction(inputs[q // 2 * 2:q // 2 * 2 + 2], ReduceOp.SUM, 1)
        other = slice(3, 6) if q % 2 == 0 else slice(0, 3)
        gathered_early[q]["SUM"][other] = node_sum[other]
    said = wrong_value(rounds_of(gathered_early), shape, numel, "float64", 0)
    assert said.startswith("all_reduce SUM on rank 0 (node 0, place 0; 2 nodes x 2 ranks): element 3 is"), said
    assert "column 1, place 1's part, which holds node 0's sum only (ranks [0, 1])" in said and "gather last" in said


def test_link_bytes_name_the_rank_the_link_and_the_flat_rings_share():
    nodes, numel = Nodes(2, 2), 8
    two_level = [link_bytes_sent("all_reduce", numel, 4, nodes, r, True) for r in range(4)]
    flat = [link_bytes_sent("all_reduce", numel, 4, nodes, r, False) for r in range(4)]
    # 32 bytes: 2(G-1)/G of them inside, 2(M-1)/M of a 16-byte column across; the flat ring's 2(N-1)/N = 48 bytes
    # all on one link -- inside at a node's first rank, across at its last
    assert two_level[0] == {INTRA: 32, INTER: 16} and flat[0] == {INTRA: 48, INTER: 0} and flat[1][INTER] == 48
    assert links_problem(rounds_of(correct((2, 2), numel), two_level), (2, 2), numel, 4) is None
    said = links_problem(rounds_of(correct((2, 2), numel), flat), (2, 2), numel, 4)
    # rank 0 sent too few across (nothing), but the verdict leads with the rank overloading the slow link
    assert said.startswith("all_reduce SUM on 2 nodes x 2 ranks, 8 x 4-byte elements: rank 1 sent 48 bytes over the "
                           "inter-node link, too many: the two-level all-reduce sends 16 there"), said
    assert "exactly the flat ring's bytes on each link" in said


def test_a_blank_skeleton_fails_naming_the_method_on_one_node_of_one_rank(pools):
    report = check("hierarchical", impl=skeleton_path("hierarchical"), examples=2, pools=pools, out=quiet)
    assert report.failed == RESULTS and "NotImplementedError: write Hierarchical._all_reduce" in report.why, report
    assert report.case.startswith("world size 1 (1 node x 1 rank)"), report.case


@pytest.mark.parametrize("impl", [None, SOLUTIONS / "guided" / "hierarchical.py"], ids=["answer", "guided"])
def test_the_answer_keys_pass_every_property(pools, impl):
    report = check("hierarchical", impl=impl, examples=2, pools=pools, out=quiet)
    assert report.ok and report.passed[1:] == [RESULTS, LINKS], (report.failed, report.why, report.case)


@pytest.mark.parametrize("mistake", known.HIERARCHICAL_MISTAKES, ids=lambda m: m.name)
def test_a_known_mistake_fails_its_property_and_is_named(pools, mistake):
    failed, words = FAILS[mistake]
    report = check("hierarchical", impl=mistake, examples=2, pools=pools, out=quiet, shrink_s=0)
    assert report.failed == failed and report.mistake == mistake.mistake, report
    assert words in report.why, report.why

"""The tree lab: the rounds on a critical path counted from the messages' order, the binomial tree's bytes, blank
skeletons failing by name, both answer keys passing, and every planted mistake -- none of them a known mistake --
failing on the property it breaks, with the known ones named."""
from __future__ import annotations

from pathlib import Path

import pytest

from minizero.comm.tree import tree_bytes_sent, tree_children, tree_rounds
from minizero.course.labs import check
from minizero.course.labs.mistakes_tree import TREE_MISTAKES
from minizero.course.labs.rounds import critical_path

HERE = Path(__file__).parent
RESULTS = "every all-reduce's result (SUM, AVG, MAX)"
COST = "rounds on the critical path and bytes per rank: the tree's"


def quiet(_):
    pass


def sends(*pairs):
    """Events of the one-port replay: ('send', peer) / ('recv', peer) (blocking), 4 bytes each."""
    return [(what, peer, 4) for what, peer in pairs]


BINOMIAL_4 = [sends(("recv", 1), ("recv", 2), ("send", 2), ("send", 1)), sends(("send", 0), ("recv", 0)),
              sends(("recv", 3), ("send", 0), ("recv", 0), ("send", 3)), sends(("send", 2), ("recv", 2))]
CHAIN_4 = [sends(("recv", 1), ("send", 1)), sends(("recv", 2), ("send", 0), ("recv", 0), ("send", 2)),
           sends(("recv", 3), ("send", 1), ("recv", 1), ("send", 3)), sends(("send", 2), ("recv", 2))]


def test_the_critical_path_counts_rounds_under_the_one_port_rule():
    assert critical_path(BINOMIAL_4) == 4 == tree_rounds(4)
    assert critical_path(CHAIN_4) == 6  # 2(N-1): the ring's latency
    nearest_first = [BINOMIAL_4[0][:2] + [BINOMIAL_4[0][3], BINOMIAL_4[0][2]], *BINOMIAL_4[1:]]
    assert critical_path(nearest_first) == 5  # rank 2 hears a round late, and so does its child
    star = [sends(("recv", 1), ("recv", 2), ("recv", 3), ("send", 1), ("send", 2), ("send", 3))] + \
        [sends(("send", 0), ("recv", 0))] * 3
    assert critical_path(star) == 6  # the root's port takes one message a round
    ring = [sends(*[("isend", (r + 1) % 3), ("recv", (r - 1) % 3)] * 4) for r in range(3)]
    assert critical_path(ring) == 4  # 2(N-1) steps, each a send and a receive at once (full duplex)
    blocking = [[("send", *event[1:]) if event[0] == "isend" else event for event in rank] for rank in ring]
    assert critical_path(blocking) == 8  # a blocking send holds the rank back: its receive comes a round later
    assert critical_path([sends(("recv", 1)), []]) is None  # a receive nobody sent to
    assert critical_path([[]]) == 0 == tree_rounds(1)


def test_the_binomial_trees_shape_and_bytes():
    assert [tree_children(r, 4) for r in range(4)] == [[2, 1], [], [3], []]
    assert [tree_children(r, 3) for r in range(3)] == [[2, 1], [], []]
    assert tree_children(0, 5) == [4, 2, 1] and [tree_rounds(n) for n in (1, 2, 3, 4, 5)] == [0, 2, 4, 4, 6]
    for n in (1, 2, 3, 4, 5, 8):  # every rank but the root receives the tensor once each way: 2(N-1) tensors
        assert sum(tree_bytes_sent(10, 4, n, r) for r in range(n)) == 2 * (n - 1) * 40
    assert max(tree_bytes_sent(10, 4, n, r) for n in (2, 3, 4) for r in range(n)) == 80  # at most 2S at N <= 4


@pytest.mark.parametrize("mistake", TREE_MISTAKES, ids=lambda m: m.name)
def test_a_known_mistake_is_named_with_its_rounds(pools, mistake):
    report = check("tree", impl=mistake, examples=3, pools=pools, out=quiet, shrink_s=0)
    assert report.failed == COST and report.mistake == mistake.mistake, report
    assert "world size 4" in report.case and "6 rounds on the critical path" in report.why, report

"""The cluster's time model term by term (issue 46, figures asserted loosely): each term of
:func:`minizero.costs.cluster_cost.collective_s` alone against one dialled collective.

The whole-step comparisons (``tests/test_cost_model.py``) hold the model within 35% of a measured step, which a wrong
inter-node term can pass when the other terms dominate.  Here the network is dialled so that one term is the only
time there is -- the slow link's alpha, its bandwidth shared by a node's rings, the fast link when it is a flat
ring's slowest hop, one node's fast wire, the two-level ring's inside and across phases, a view's ring -- and that
collective's measured time is held to the term: at least the formula (a dialled port holds each message alpha +
bytes/bandwidth, and load only adds time), at most 1.3x it plus 15 ms (a barrier's skew, the loopback).  A term off
by a factor (N for M, the node's rings not sharing its link, the slow wire where one node has only the fast one)
falls outside one side or the other: seven such mutants of ``collective_s`` each fail here.
"""
from __future__ import annotations

import time

import pytest
import torch

from minizero.comm import Nodes, make_comm, parse_network
from minizero.costs.cluster_cost import collective_s

SMALL, LARGE = 4_000, 100_000  # float32 elements: alpha-bound (16 KB), bandwidth-bound (400 KB: 10 ms a quarter)


def _timed(me, backend: str, network: str, kind: str, numel: int, span: str) -> list[tuple[float, float]]:
    """When one ``kind`` of ``numel`` elements among the ``span`` ranks began and ended on this rank, twice
    (``time.perf_counter``: the machine's monotonic clock, one for every process)."""
    comm = make_comm(backend, network=network)
    if span == "world":
        ring = comm
    else:
        ring = comm.over(comm.nodes.node_ranks(me.rank) if span == "node" else comm.nodes.across_ranks(me.rank))
    n = ring.world_size

    def once():
        if kind == "all_reduce":
            ring.all_reduce(torch.ones(numel))
        elif kind == "reduce_scatter":
            ring.reduce_scatter(torch.empty(numel // n), torch.ones(numel))
        else:
            ring.all_gather(torch.empty(numel), torch.ones(numel // n))

    try:
        once()  # the connections made
        spans = []
        for _ in range(2):
            torch.distributed.barrier()
            start = time.perf_counter()
            once()
            spans.append((start, time.perf_counter()))
        return spans
    finally:
        comm.close()


#: (what the term is, network, backend, collective, elements, span, world size)
TERMS = [
    ("the slow link's alpha, 2(N-1) times in a flat ring", "nodes=2x2,inter=20ms/100GB/s", "ring", "all_reduce",
     SMALL, "world", 4),
    ("the slow link's bandwidth, S/N a step", "nodes=2x2,inter=0ms/10MB/s", "ring", "all_reduce", LARGE, "world", 4),
    ("the fast link when it is a flat step's slowest hop", "nodes=2x2,intra=20ms/100GB/s", "ring", "reduce_scatter",
     SMALL, "world", 4),
    ("one node: its fast wire only", "nodes=1x2,intra=20ms/100GB/s,inter=50ms/100GB/s", "ring", "all_reduce", SMALL,
     "world", 2),
    ("two-level: 2(G-1) steps inside", "nodes=2x2,intra=20ms/100GB/s", "hierarchical", "all_reduce", SMALL, "world", 4),
    ("two-level: 2(M-1) steps across, the G rings sharing the node's link", "nodes=2x2,inter=0ms/10MB/s",
     "hierarchical", "all_reduce", LARGE, "world", 4),
    ("a node's ring (HSDP's shard group)", "nodes=2x2,intra=0ms/10MB/s", "ring", "all_gather", LARGE, "node", 4),
    ("the across ring (HSDP's replicas), every place's at once through the node's link", "nodes=2x2,inter=0ms/10MB/s",
     "ring", "all_reduce", LARGE, "across", 4),
]


@pytest.mark.parametrize("term, network, backend, kind, numel, span, world_size", TERMS, ids=[t[0] for t in TERMS])
def test_each_term_of_the_cluster_model_is_the_dialled_time_of_its_collective(pools, term, network, backend, kind,
                                                                              numel, span, world_size):
    net = parse_network(network)
    predicted, _ = collective_s(kind, 4 * numel, net, Nodes(net.nodes.count, net.nodes.per_node), span,
                                hierarchical=backend == "hierarchical")
    ranks = pools.run(world_size, _timed, backend, network, kind, numel, span)
    # From the first rank's start to the last one's end: a rank that left the barrier late finds the link already
    # carrying its peers' messages, and its own clock alone would miss that wait (64 ms seen for an 80 ms term).
    # The better of two: load only adds time.
    measured = min(max(end for _, end in tries) - min(start for start, _ in tries) for tries in zip(*ranks, strict=True))
    assert predicted >= 0.02, (term, predicted)  # the term is the time there is
    assert 0.97 * predicted <= measured <= 1.3 * predicted + 0.015, \
        f"{term}: measured {measured * 1e3:.1f} ms, the model says {predicted * 1e3:.1f} ms"

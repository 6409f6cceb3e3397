"""The flat network's time model term by term (issue 46, figures asserted loosely): each formula of
:mod:`minizero.costs.cost_model` alone against one dialled collective on one flat α–β network.

``tests/test_cost_model.py`` holds whole steps within 35% of the model; a term there can be off by a factor and hide
behind the others.  Here the wire is dialled so that one term is all the time there is -- the ring's ``alpha``
``RING_STEPS (N-1)`` times, its ``S/(N beta)`` a step, the root's N-1 inbound shards through one port then N-1
sends in turn, the parameter server's push (the server's port or the worker's sends, the slower) and pull -- and
that collective's measured time is held to its formula: at least 0.97 of it (a dialled port holds each message
``alpha + bytes/bandwidth``; load only adds time), at most 1.3x plus 15 ms (a barrier's skew, the loopback).
:func:`~minizero.costs.cluster_cost.collective_s` on a flat network must agree with :func:`ring_s` exactly: the
two places the ring's formula is written.  Six mutants of the formulas each fail a row here (seen): the ring's N for
N-1, its shard's ``1/N`` dropped, the push's max taken as a sum, the root's inbound latencies not overlapped, the
pull's N-1 messages as N, and a worker's sends counted as S where every rank serves (its own shard stays).
"""
from __future__ import annotations

import time

import pytest
import torch

from minizero.comm import make_comm, parse_network
from minizero.costs.cluster_cost import collective_s, nodes_for
from minizero.costs.cost_model import pull_s, push_s, ring_s, root_all_reduce_s

SMALL, LARGE = 1_200, 120_000  # float32 elements, divisible by 1-4 ranks: alpha-bound (4.8 KB), bandwidth-bound


def _call(comm, kind: str, numel: int, servers: int) -> None:
    n = comm.world_size
    if kind == "all_reduce":
        comm.all_reduce(torch.ones(numel))
    elif kind == "reduce_scatter":
        comm.reduce_scatter(torch.empty(numel // n), torch.ones(numel))
    elif kind == "all_gather":
        comm.all_gather(torch.empty(numel), torch.ones(numel // n))
    elif kind == "root_all_reduce":
        comm.root_all_reduce(torch.ones(numel))
    elif kind == "push":
        comm.push(torch.empty(numel // servers if comm.rank < servers else 0), torch.ones(numel), servers)
    else:
        comm.pull(torch.empty(numel), torch.ones(numel // servers if comm.rank < servers else 0), servers)


def _timed(me, network: str, kind: str, numel: int, servers: int) -> list[tuple[float, float]]:
    """When one ``kind`` of ``numel`` elements began and ended on this rank, twice (``time.perf_counter``: the
    machine's monotonic clock, one for every process)."""
    comm = make_comm("ring", network=network)
    try:
        _call(comm, kind, numel, servers)  # the connections made
        spans = []
        for _ in range(2):
            torch.distributed.barrier()
            start = time.perf_counter()
            _call(comm, kind, numel, servers)
            spans.append((start, time.perf_counter()))
        return spans
    finally:
        comm.close()


ALPHA, BETA = "alpha=20ms,bandwidth=100GB/s", "alpha=0ms,bandwidth=10MB/s"

#: (what the term is, network, collective, elements, world size, servers)
TERMS = [
    ("the ring's alpha, 2(N-1) times in an all-reduce", ALPHA, "all_reduce", SMALL, 3, 0),
    ("the ring's alpha, N-1 times in a reduce-scatter", ALPHA, "reduce_scatter", SMALL, 4, 0),
    ("the ring's S/(N beta) a step, 2(N-1) steps", BETA, "all_reduce", LARGE, 3, 0),
    ("the ring's S/(N beta) a step, N-1 steps of an all-gather", BETA, "all_gather", LARGE, 4, 0),
    ("the ring's S/(N beta) at two ranks", BETA, "reduce_scatter", LARGE, 2, 0),
    ("the root's inbound alphas overlapped, then N-1 sends in turn", ALPHA, "root_all_reduce", SMALL, 4, 0),
    ("the root's N-1 tensors through one port, then N-1 out", BETA, "root_all_reduce", LARGE // 4, 3, 0),
    ("one server's port takes N-1 shards", BETA, "push", LARGE // 2, 4, 1),
    ("every rank a server: a worker's N-1 sends, one after another", ALPHA, "push", SMALL, 4, 4),
    ("every rank a server: N-1 shards of S/N through each port", BETA, "push", LARGE, 4, 4),
    ("one server sends its shard to N-1 ranks in turn", BETA, "pull", LARGE // 2, 3, 1),
    ("the pull's alpha, N-1 messages from each server", ALPHA, "pull", SMALL, 3, 3),
]


def _formula(kind: str, nbytes: float, world_size: int, servers: int, network) -> float:
    if kind in ("all_reduce", "reduce_scatter", "all_gather"):
        return ring_s(kind, nbytes, world_size, network)
    if kind == "root_all_reduce":
        return root_all_reduce_s(nbytes, world_size, network)
    return (push_s if kind == "push" else pull_s)(nbytes, world_size, servers, network)


@pytest.mark.parametrize("term, network, kind, numel, world_size, servers", TERMS, ids=[t[0] for t in TERMS])
def test_each_term_of_the_flat_model_is_the_dialled_time_of_its_collective(pools, term, network, kind, numel,
                                                                           world_size, servers):
    net = parse_network(network)
    predicted = _formula(kind, 4 * numel, world_size, servers, net)
    ranks = pools.run(world_size, _timed, network, kind, numel, servers)
    # From the first rank's start to the last one's end, the better of two: load only adds time.
    measured = min(max(end for _, end in tries) - min(start for start, _ in tries) for tries in zip(*ranks, strict=True))
    assert predicted >= 0.02, (term, predicted)  # the term is the time there is
    assert 0.97 * predicted <= measured <= 1.3 * predicted + 0.015, \
        f"{term}: measured {measured * 1e3:.1f} ms, the model says {predicted * 1e3:.1f} ms"


@pytest.mark.parametrize("kind", ["all_reduce", "reduce_scatter", "all_gather"])
@pytest.mark.parametrize("world_size", [1, 2, 3, 4, 7])
def test_the_cluster_model_on_a_flat_network_is_the_flat_ring(kind, world_size):
    """Two places write the ring's formula (the flat model's :func:`ring_s` and the cluster model's flat branch):
    they must agree, seconds and alpha part, at every world size."""
    net = parse_network("alpha=3ms,bandwidth=7MB/s")
    seconds, alpha = collective_s(kind, 1e6, net, nodes_for(world_size, net))
    assert seconds == pytest.approx(ring_s(kind, 1e6, world_size, net), rel=1e-12)
    steps = {"all_reduce": 2, "reduce_scatter": 1, "all_gather": 1}[kind] * (world_size - 1)
    assert alpha == pytest.approx(steps * 3e-3, rel=1e-12)

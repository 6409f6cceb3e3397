"""Two-level collectives (:mod:`minizero.comm.hierarchical`) against the flat ring, on every node shape of up to
four ranks: the same values (bit for bit on integer data, whose sums are exact in any order) and, per link class,
exactly the bytes of their formulas -- the slow link carrying what the two-level algorithm says, not the flat
ring's share."""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from minizero.comm import INTER, INTRA, Nodes, ReduceOp
from minizero.comm.hierarchical import link_bytes_sent
from tests.equivalence import examples
from tests.test_comm import _collective_on_rank, expected

SHAPES = [(m, g) for m in range(1, 5) for g in range(1, 5) if m * g <= 4]  # nodes x ranks per node


def _two_level_on_rank(me, case, shape, backend):
    kind, numel, dtype, op, seed = case
    return _collective_on_rank(me, (kind, numel, dtype, op, backend, seed, 0), f"nodes={shape[0]}x{shape[1]}")


cases = st.tuples(st.sampled_from(["all_reduce", "reduce_scatter", "all_gather"]),
                  st.integers(0, 29),  # per shard for reduce-scatter / all-gather; fewer than ranks included
                  st.sampled_from([torch.float32, torch.float64, torch.int64, torch.bfloat16]),
                  st.sampled_from([ReduceOp.SUM, ReduceOp.AVG, ReduceOp.MAX]),
                  st.integers(0, 10_000))


@pytest.mark.parametrize("backend", ["hierarchical", "ring", "native"])
@pytest.mark.parametrize("shape", SHAPES)
@settings(max_examples=examples(12))
@given(case=cases)
def test_two_level_collectives_match_the_flat_ring_and_their_link_bytes(pools, shape, case, backend):
    kind, numel, dtype, op, seed = case
    if op is ReduceOp.AVG and dtype in (torch.int64, torch.bfloat16):
        op = ReduceOp.SUM  # ints have no mean; a 16-bit mean rounds where the division happens
        case = (kind, numel, dtype, op, seed)
    nodes = Nodes(*shape)
    results = pools.run(nodes.world_size, _two_level_on_rank, case, shape, backend)
    full_numel = numel * nodes.world_size if kind != "all_reduce" else numel
    for rank, (out, sent, links) in enumerate(results):
        want = expected(kind, rank, nodes.world_size, numel, dtype, op, seed, 0)
        if op is ReduceOp.AVG:  # the same sum, divided once by N: equal where N is a power of two
            torch.testing.assert_close(out, want, rtol=1e-6, atol=0)
        else:
            assert torch.equal(out, want), f"{backend} {shape} rank {rank}: {out} != {want}"
        model = link_bytes_sent(kind, full_numel, out.element_size(), nodes, rank, backend == "hierarchical")
        assert {k: links.get(k, 0) for k in (INTRA, INTER)} == model, (backend, shape, rank, links, model)
        assert sum(links.values()) == sum(sent.values()) and set(sent) <= {kind}


def test_the_slow_link_carries_half_at_two_nodes(pools):
    """2 nodes x 2 ranks, 4096 float32 all-reduced: the flat ring puts 2(N-1)/N x S = 1.5 S through each node's
    link (its last rank's every step), the hierarchical one 2(M-1)/M x S = S, shared by the node's two ranks."""
    numel, s = 4096, 4096 * 4
    flat = pools.run(4, _two_level_on_rank, ("all_reduce", numel, torch.float32, ReduceOp.SUM, 1), (2, 2), "ring")
    two = pools.run(4, _two_level_on_rank, ("all_reduce", numel, torch.float32, ReduceOp.SUM, 1), (2, 2), "hierarchical")
    node0 = lambda results: sum(results[r][2].get(INTER, 0) for r in (0, 1))  # noqa: E731
    assert node0(flat) == 3 * s // 2 and node0(two) == s
    assert [r[2].get(INTRA, 0) for r in two] == [s] * 4  # 2(G-1)/G x S inside each node, per rank


def _subgroups_of_two_comms(me):
    from minizero.comm import make_comm
    first, second = (make_comm("native", network="nodes=2x2") for _ in range(2))
    return [first._subgroups[k] is second._subgroups[k] for k in first._subgroups], len(first._subgroups)


def test_a_native_comm_built_again_reuses_its_process_groups(pools):
    """A process group lives until destroyed (in gloo, a loop thread waking every 10 ms): a Comm built per example
    that made its own leaked hundreds of threads into the suite's pools.  The same nodes get the same groups."""
    for same, count in pools.run(4, _subgroups_of_two_comms):
        assert count == 4 and all(same), (count, same)

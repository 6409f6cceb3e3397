"""Collectives built from send/recv: right values, and exactly the right bytes.

Values are small integers, exact in every dtype down to float16, so any
summation order gives the same bits and results are compared for equality.
"""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from minizero.comm import Ledger, ReduceOp, chunk_bounds, make_comm, ring_bytes_sent
from tests.equivalence import examples

DTYPES = [torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.int64]


def contribution(rank: int, numel: int, dtype, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed * 101 + rank)
    return torch.randint(-8, 9, (numel,), generator=g).to(dtype)


def _collective_on_rank(me, case, network=None):
    """``case``'s collective on this rank: its result and the ledger (with ``network``'s nodes, also the bytes per
    link class: tests/test_hierarchical.py)."""
    kind, numel, dtype, op, backend, seed, src = case
    comm = make_comm(backend.removesuffix("-paired"), network=network)
    if backend == "ring-paired":  # the path NCCL takes: each step's send and receive in one batch_isend_irecv
        comm._pair_steps = True
    ledger = Ledger()
    n = me.world_size
    with ledger.attached(comm):
        if kind == "all_reduce":
            out = contribution(me.rank, numel, dtype, seed)
            comm.all_reduce(out, op)
        elif kind == "root_all_reduce":
            out = contribution(me.rank, numel, dtype, seed)
            comm.root_all_reduce(out, op)
        elif kind == "reduce_scatter":
            full = contribution(me.rank, numel * n, dtype, seed)
            before = full.clone()
            out = torch.full((numel,), 99, dtype=dtype)
            comm.reduce_scatter(out, full, op)
            assert torch.equal(full, before), "reduce_scatter must not modify its input"
        elif kind == "all_gather":
            out = torch.full((numel * n,), 99, dtype=dtype)
            comm.all_gather(out, contribution(me.rank, numel, dtype, seed))
        elif kind == "broadcast":
            out = contribution(me.rank, numel, dtype, seed)
            comm.broadcast(out, src)
    comm.close()
    return (out, ledger.snapshot()) if network is None else (out, ledger.snapshot(), ledger.links())


def expected(kind, rank, n, numel, dtype, op, seed, src):
    parts = [contribution(r, numel * (n if kind == "reduce_scatter" else 1), dtype, seed).double() for r in range(n)]
    if kind in ("all_reduce", "root_all_reduce", "reduce_scatter"):
        total = torch.stack(parts).max(dim=0).values if op is ReduceOp.MAX and parts[0].numel() else sum(parts)
        if op is ReduceOp.AVG:
            total = total / n
        return (total.view(n, numel)[rank] if kind == "reduce_scatter" else total).to(dtype)
    if kind == "all_gather":
        return torch.cat(parts).to(dtype)
    return parts[src].to(dtype)


cases = st.tuples(
    st.sampled_from(["all_reduce", "reduce_scatter", "all_gather", "broadcast", "root_all_reduce"]),
    st.integers(0, 37),  # numel (per shard for reduce_scatter/all_gather); 0 and < world_size included
    st.sampled_from(DTYPES),
    st.sampled_from([ReduceOp.SUM, ReduceOp.AVG, ReduceOp.MAX]),
    st.sampled_from(["ring", "native", "ring-paired"]),
    st.integers(0, 10_000),
    st.integers(0, 3),
)


@settings(max_examples=examples(100))
@given(world_size=st.integers(1, 4), case=cases)
def test_collectives_match_math_and_ledger(pools, world_size, case):
    kind, numel, dtype, op, backend, seed, src = case
    src = src % world_size
    case = (kind, numel, dtype, op, backend, seed, src)
    if op is ReduceOp.AVG and dtype in (torch.float16, torch.bfloat16, torch.int64):
        op = ReduceOp.SUM  # x/3 rounds differently depending on where the division happens; ints have no mean
        case = (kind, numel, dtype, op, backend, seed, src)
    results = pools.run(world_size, _collective_on_rank, case)
    full_numel = numel * world_size if kind in ("reduce_scatter", "all_gather") else numel
    for rank, (out, sent) in enumerate(results):
        want = expected(kind, rank, world_size, numel, dtype, op, seed, src)
        if op is ReduceOp.AVG:
            torch.testing.assert_close(out, want, rtol=1e-6, atol=0)
        else:
            assert torch.equal(out, want), f"rank {rank}: {out} != {want}"
        modelled = ring_bytes_sent(kind, full_numel, out.element_size(), world_size, rank, src)
        assert sum(sent.values()) == modelled, f"rank {rank} sent {sent}, model says {modelled}"
        assert set(sent) <= {kind}, f"bytes booked under {set(sent)}, expected only {kind}"


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_ring_all_reduce_sends_2_n_minus_1_over_n(pools, world_size):
    """The paper's number, exactly: 2(N-1)/N * S bytes per rank when N divides the tensor."""
    numel = 12 * 1024
    results = pools.run(world_size, _collective_on_rank, ("all_reduce", numel, torch.float32, ReduceOp.SUM, "ring", 1, 0))
    for _, sent in results:
        assert sent["all_reduce"] == 2 * (world_size - 1) * numel * 4 // world_size


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_root_all_reduce_root_sends_n_minus_1_times(pools, world_size):
    numel = 1000
    results = pools.run(world_size, _collective_on_rank,
                        ("root_all_reduce", numel, torch.float32, ReduceOp.SUM, "ring", 1, 0))
    assert results[0][1]["root_all_reduce"] == (world_size - 1) * numel * 4
    for _, sent in results[1:]:
        assert sent["root_all_reduce"] == numel * 4


def _all_to_all_on_rank(me, backend: str, numel: int, dtype):
    from minizero.comm import Ledger
    comm = make_comm(backend)
    ledger = Ledger()
    comm.add_observer(ledger)
    n, r = comm.world_size, comm.rank
    # rank r's chunk j holds 10 r + 3 j, plus the position: who sent what, and where, is visible (and fits a uint8)
    sent = torch.cat([torch.arange(numel // n, dtype=torch.float64) + 10 * r + 3 * j for j in range(n)]).to(dtype)
    got = torch.full_like(sent, -1)
    comm.all_to_all(got, sent)
    comm.close()
    return got, ledger.snapshot()


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
@pytest.mark.parametrize("backend", ["ring", "native"])
def test_all_to_all_sends_each_chunk_to_its_owner_and_nothing_more(pools, world_size, backend):
    """Chunk j of rank i arrives as chunk i on rank j, untouched (uint8 too: a codec's messages); each rank
    sends (N-1)/N of the tensor."""
    numel = 6 * world_size
    for dtype in (torch.float32, torch.uint8):
        results = pools.run(world_size, _all_to_all_on_rank, backend, numel, dtype)
        for j, (got, sent) in enumerate(results):
            want = torch.cat([torch.arange(6, dtype=torch.float64) + 10 * i + 3 * j
                              for i in range(world_size)]).to(dtype)
            assert torch.equal(got, want), (world_size, j, dtype)
            assert sent.get("all_to_all", 0) == (world_size - 1) * 6 * torch.empty(0, dtype=dtype).element_size()


def test_chunk_bounds_padding_rule():
    assert chunk_bounds(0, 3) == [(0, 0), (0, 0), (0, 0)]
    assert chunk_bounds(2, 3) == [(0, 1), (1, 2), (2, 2)]
    assert chunk_bounds(7, 3) == [(0, 3), (3, 5), (5, 7)]
    assert [b - a for a, b in chunk_bounds(10, 4)] == [3, 3, 2, 2]


def _async_on_rank(me):
    comm = make_comm("ring")
    tensors = [torch.full((1000,), float(me.rank + i)) for i in range(4)]
    works = [comm.all_reduce(t, ReduceOp.SUM, async_op=True) for t in tensors]
    for w in works:
        w.wait()
    comm.close()
    return tensors


def test_async_collectives_complete_in_order(pools):
    n = 3
    for rank_result in pools.run(n, _async_on_rank):
        for i, t in enumerate(rank_result):
            assert torch.equal(t, torch.full((1000,), float(sum(range(n)) + n * i)))


def _bad_shard_on_rank(me):
    comm = make_comm("ring")
    comm.reduce_scatter(torch.empty(3), torch.empty(7))


def test_reduce_scatter_rejects_unpadded_input(pools):
    from minizero.run.launch import RankError
    with pytest.raises(RankError, match="pad the full tensor"):
        pools.run(2, _bad_shard_on_rank)


def _refused_on_rank(me, what):
    comm = make_comm("ring")
    try:
        if what == "complex":
            comm.all_reduce(torch.ones(3, dtype=torch.complex64))
        elif what == "int-avg":
            comm.all_reduce(torch.ones(3, dtype=torch.int64), ReduceOp.AVG)
        elif what == "strided":
            comm.broadcast(torch.ones(4, 4).t())
    except (TypeError, ValueError) as error:
        return str(error)


@pytest.mark.parametrize("what, message", [("complex", "rank 0: all_reduce for (untagged): dtype torch.complex64 is not supported"),
                                           ("int-avg", "AVG of torch.int64 is not defined"),
                                           ("strided", "must be contiguous")])
def test_what_a_collective_cannot_take_is_refused_naming_the_rank(pools, what, message):
    """Checked before the fingerprint exchange and before any byte moves, on every rank alike."""
    results = pools.run(2, _refused_on_rank, what)
    assert message.replace("rank 0", "rank 1") in results[1] or message in results[1]
    assert message in results[0]


def _chunk_lists_on_rank(me, phase):
    """A node's ring (a view over ranks 1 and 2 of 3) handed one chunk where it has two ranks: the hierarchical lab's
    ``torch.chunk`` of a 1-element tensor."""
    comm = make_comm("ring")
    refused = None
    if me.rank:
        node = comm.over([1, 2])
        chunks = list(torch.ones(1).chunk(node.world_size))
        try:
            if phase == "reduce-scatter":
                node._ring_reduce_scatter(chunks, chunks[0], ReduceOp.SUM)
            else:
                node._ring_all_gather(chunks)
        except ValueError as error:
            refused = str(error)
    comm.all_reduce(torch.ones(2))  # still in step: nothing had left
    comm.close()
    return refused


@pytest.mark.parametrize("phase", ["reduce-scatter", "all-gather"])
def test_a_ring_phase_handed_a_chunk_list_not_one_per_rank_refuses_naming_the_rank(pools, phase):
    """Before any message leaves (else a rank indexes past the list, or pairs its chunk with the wrong peer's)."""
    results = pools.run(3, _chunk_lists_on_rank, phase)
    assert results[0] is None
    for rank in (1, 2):
        assert f"rank {rank}: the ring's {phase} takes one chunk per rank of its ring (2)" in results[rank], results
        assert "and got 1 -- torch.chunk and torch.split return fewer pieces than asked" in results[rank], results


def test_each_backend_gets_memory_it_can_move():
    """NCCL takes CUDA memory only; gloo's send/recv take host memory only (a CUDA address there failed on an
    H200 with ``writev ... Bad address``); gloo's own collectives take either."""
    from minizero.comm.placement import travels_through
    cpu, cuda = torch.device("cpu"), torch.device("cuda", 0)
    assert travels_through(nccl=True, point_to_point=False, device=cpu) == "cuda"
    assert travels_through(nccl=True, point_to_point=True, device=cpu) == "cuda"
    assert travels_through(nccl=True, point_to_point=True, device=cuda) is None
    assert travels_through(nccl=False, point_to_point=True, device=cuda) == "cpu"
    assert travels_through(nccl=False, point_to_point=True, device=cpu) is None
    assert travels_through(nccl=False, point_to_point=False, device=cuda) is None


def test_every_collective_built_from_send_recv_is_marked_point_to_point():
    """The mark decides whether gloo's CUDA tensors detour through host memory: a ring collective left
    unmarked would hand gloo a CUDA address on a GPU and crash there, where CI cannot see it."""
    from minizero.comm.native import NativeComm
    from minizero.comm.ring import RingComm
    from minizero.comm.tree import TreeComm
    torch_collectives = ("all_reduce", "reduce_scatter", "all_gather", "broadcast", "root_all_reduce")
    for cls in (RingComm, TreeComm, NativeComm):
        for kind in torch_collectives + ("push", "pull", "all_to_all"):  # the direct exchanges: send/recv everywhere
            built_from_send_recv = cls is not NativeComm or kind in ("push", "pull", "all_to_all")
            assert getattr(getattr(cls, kind), "point_to_point", None) is built_from_send_recv, (cls.__name__, kind)


def test_the_progress_board_still_says_no_part_with_its_last_entry():
    """A collective enters the board at "no part yet" -- the last of PARTS -- until its first step says which."""
    from minizero.comm.progress import PARTS
    assert PARTS[-1] == "" and "all-to-all" in PARTS

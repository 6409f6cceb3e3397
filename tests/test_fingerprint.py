"""Collective-order checking: ranks that disagree stop before any data moves, every rank naming both calls."""
from __future__ import annotations

import pytest
import torch

from minizero.comm import CollectiveMismatch, Ledger, Tag, make_comm
from minizero.run.launch import RankError


def _disagree(me, backend, case):
    """Rank 1 does something else than the others; every rank returns what it raised."""
    comm = make_comm(backend, check=True)
    odd = me.rank == 1
    messages = []
    try:
        if case == "numel":
            comm.all_reduce(torch.ones(5 if odd else 4), tag=Tag("bucket 0"))
        elif case == "tag":
            comm.all_reduce(torch.ones(4), tag=Tag("bucket 1" if odd else "bucket 0"))
        elif case == "extra":
            if not odd:
                comm.all_reduce(torch.ones(4), tag=Tag("clip norm"))
            comm.all_gather(torch.empty(4 * me.world_size), torch.ones(4), tag=Tag("parameters after step"))
        elif case == "no_sync":
            comm.all_reduce(torch.ones(4), tag=Tag("bucket 0", step=0, backward=1 if odd else 2, syncing=1))
        elif case == "unit":
            comm.all_gather(torch.empty(4 * me.world_size), torch.ones(4),
                            tag=Tag(f"unit {2 if odd else 1} forward all-gather", step=0, backward=1, syncing=1))
    except CollectiveMismatch as error:
        messages.append(str(error))
    # Every rank raised at the same call, so the Comm is still in step: a correct collective works.
    t = torch.ones(3)
    comm.all_reduce(t, tag=Tag("after the mismatch"))
    return messages, t.tolist()


CAUSES = {"numel": "tensors of different sizes", "tag": "collectives in a different order",
          "extra": "collectives in a different order", "no_sync": "no_sync() was entered on some ranks only",
          "unit": "a module was called a different number of times"}


@pytest.mark.parametrize("backend", ["ring", "native"])
@pytest.mark.parametrize("case", sorted(CAUSES))
@pytest.mark.parametrize("world_size", [2, 3])
def test_a_disagreement_is_named_on_every_rank_before_data_moves(pools, backend, case, world_size):
    results = pools.run(world_size, _disagree, backend, case)
    for rank, (messages, after) in enumerate(results):
        assert len(messages) == 1, f"rank {rank} did not raise"
        message = messages[0]
        assert message.startswith(f"rank {rank}: ranks disagree on the next collective")
        assert all(f"  rank {r}: #1 " in message for r in range(world_size))  # what each rank was doing
        assert CAUSES[case] in message
        assert after == [float(world_size)] * 3


def test_the_message_says_what_each_rank_was_about_to_do(pools):
    (message,), _ = pools.run(2, _disagree, "ring", "no_sync")[0]
    assert "rank 0: #1 all_reduce of 4 float32 (sum) for 'bucket 0', step 0, backward 2, synchronising" in message
    assert "rank 1: #1 all_reduce of 4 float32 (sum) for 'bucket 0', step 0, backward 1, synchronising" in message


def _swapped(me, check):
    """Rank 1 reduces its two tensors in the other order: same sizes, so nothing but a check can tell."""
    comm = make_comm("ring", check=check)
    a, b = torch.full((4,), 1.0 + me.rank), torch.full((4,), 10.0 * (1 + me.rank))
    order = [("a", a), ("b", b)] if me.rank == 0 else [("b", b), ("a", a)]
    try:
        for name, t in order:
            comm.all_reduce(t, tag=Tag(name))
    except CollectiveMismatch:
        return "refused"
    return a[0].item(), b[0].item()


def test_without_the_check_a_swap_is_a_silent_wrong_answer_with_it_an_error(pools):
    wrong = pools.run(2, _swapped, False)
    assert wrong[0] != (3.0, 30.0)  # a + a would be 3, b + b 30: rank 0 added a to rank 1's b
    assert pools.run(2, _swapped, True) == ["refused", "refused"]


def _ledger(me, check, backend):
    comm = make_comm(backend, check=check)
    ledger = Ledger()
    with ledger.attached(comm):
        comm.all_reduce(torch.ones(1000))
        comm.reduce_scatter(torch.empty(333), torch.ones(999))
    return ledger.snapshot()


@pytest.mark.parametrize("backend", ["ring", "native"])
def test_fingerprint_bytes_are_booked_apart_from_the_training_traffic(pools, backend):
    plain, checked = pools.run(3, _ledger, False, backend)[0], pools.run(3, _ledger, True, backend)[0]
    assert "check" not in plain
    assert {k: v for k, v in checked.items() if k != "check"} == plain
    assert checked["check"] == 2 * 2 * 9 * 8  # two calls: a ring all-gather of 9 float64 per rank, N-1 = 2 steps


def _after_a_part_way_failure(me):
    """A collective fails on rank 1 after its first message left; the Comm refuses every later one."""
    comm = make_comm("ring")
    boom = {"armed": me.rank == 1}

    def fail_once(kind, nbytes):
        if boom["armed"]:
            boom["armed"] = False
            raise RuntimeError("injected")
    comm.add_observer(fail_once)
    try:
        comm.all_reduce(torch.ones(8), tag=Tag("bucket 0"))
    except RuntimeError:
        pass
    comm.all_reduce(torch.ones(8), tag=Tag("bucket 1"))  # rank 1: refused at once, before sending


def test_a_comm_whose_collective_failed_part_way_refuses_the_next(pools):
    """Its next message would pair with the rest of the failed one (gloo aborts on the size mismatch)."""
    with pytest.raises(RankError) as info:  # rank 0 is left waiting; the pool names rank 1's refusal
        pools.run(2, _after_a_part_way_failure)
    assert "no more collectives on this Comm: #1 all_reduce of 8 float32 (sum) for 'bucket 0' failed part-way" \
        in str(info.value)


def _a_logging_forward_on_rank_0(me):
    """Rank 0 runs an extra forward with autograd on and never backpropagates it (logging a loss, say):
    nothing to synchronise, so nothing for the fingerprints to object to."""
    from minizero.course.harness.models import MLP
    from minizero.stages import make_stage
    model = MLP((4, 4), seed=0)
    stage = make_stage("ddp-bucketed", model, torch.optim.SGD(model.parameters(), lr=0.1),
                       make_comm("ring", check=True))
    for step in range(2):
        stage.zero_grad()
        x = torch.randn(2, 4, generator=torch.Generator().manual_seed(step))
        if me.rank == 0:
            stage(x).sum().item()
        stage(x).pow(2).sum().backward()
        stage.step()
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def test_a_forward_without_backward_on_one_rank_is_not_a_disagreement(pools):
    rank0, rank1 = pools.run(2, _a_logging_forward_on_rank_0)
    assert torch.equal(rank0, rank1)

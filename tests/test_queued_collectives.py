"""Collectives issued with ``async_op=True`` on a dialled network run back to back on the wire, as on a CUDA stream:
the communication thread does not sleep between them, and whoever waits for one sleeps until the wire has it in
(:class:`minizero.comm.thread.DueWork`).  Asserted on the port's own records, to the float -- not on wall time."""
from __future__ import annotations

import time

import pytest
import torch

from minizero.comm import make_comm
from minizero.run.launch import RankPool
from tests.equivalence import train_here

WIRE = "alpha=30ms,bandwidth=1GB/s"  # each message 30 ms on the wire, far above loopback's own time however busy
QUEUED = 3


@pytest.fixture(scope="module")
def pool3():
    with RankPool(3) as pool:
        yield pool


def _queued(me, backend: str):
    comm = make_comm(backend, network=WIRE)
    comm.port.messages = []  # record every message: (left, arrives, kind, bytes, thread)
    try:
        comm.all_gather(torch.empty(3), torch.zeros(1))  # warm-up, waited for where it is called
        outputs = [torch.empty(3 * 2) for _ in range(QUEUED)]
        works = [comm.all_gather(out, torch.full((2,), 10.0 * k + me.rank), async_op=True)
                 for k, out in enumerate(outputs)]
        done_at_once = [work.done() for work in works]
        returned, last_done_early = [], None
        for work in works:
            work.wait()
            returned.append(time.perf_counter())
            if last_done_early is None:  # the thread is through with every message by now; the wire is not
                last_done_early = works[-1].done()
        return {"last_done_early": last_done_early, "messages": [m[:2] for m in comm.port.messages],
                "returned": returned, "done_at_once": done_at_once, "outputs": [out.tolist() for out in outputs]}
    finally:
        comm.close()


@pytest.mark.parametrize("backend", ["ring", "native"])
def test_queued_collectives_leave_at_the_moment_the_last_one_ended_and_are_waited_for_until_then(pool3, backend):
    """Ring all-gathers at N = 3, two messages each per rank.  A queued collective's first message leaves exactly when
    the one before it ended on this rank -- its own last message arrived (``max`` with) the last message in from the
    left -- with nothing of the host's wake-up in between (a thread that slept to each end, as a collective called
    where it waits does, would leave later).  And each ``wait()`` returns no earlier than that end."""
    ranks = pool3.run(_queued, backend)
    world = len(ranks)
    per = 2  # messages per rank per all-gather at N = 3
    collectives = [[r["messages"][per * (1 + k): per * (2 + k)] for k in range(QUEUED)] for r in ranks]
    for rank, got in enumerate(ranks):
        left = (rank - 1) % world
        assert got["outputs"] == [[10.0 * k + r for r in range(world) for _ in range(2)] for k in range(QUEUED)]
        assert not any(got["done_at_once"]) and not got["last_done_early"], (
            f"rank {rank}: a collective was done before the wire had it in")
        for k in range(QUEUED):
            ended = max(collectives[rank][k][-1][1], collectives[left][k][-1][1])
            assert got["returned"][k] >= ended, f"rank {rank}: wait() for collective {k} returned before its end"
            if k > 0:
                before = max(collectives[rank][k - 1][-1][1], collectives[left][k - 1][-1][1])
                assert collectives[rank][k][0][0] == before, (
                    f"rank {rank}: collective {k} left {1e3 * (collectives[rank][k][0][0] - before):+.3f} ms after "
                    f"collective {k - 1} ended on the wire")


def test_waiting_for_all_waits_for_every_one_and_raises_the_first_error():
    """A failed all-gather among a step's queued ones: the rest are still waited for (nothing left running into the
    next step), and the error raised is the first one's."""
    from minizero.comm.thread import wait_all

    class Fake:
        def __init__(self, error=None):
            self.error, self.waited = error, 0

        def wait(self):
            self.waited += 1
            if self.error is not None:
                raise self.error

    works = [Fake(), Fake(ValueError("the first")), Fake(RuntimeError("the second")), Fake()]
    with pytest.raises(ValueError, match="the first"):
        wait_all(works)
    assert [w.waited > 0 for w in works] == [True, True, True, True]


def _gathers_in_order(me, exp):
    """ZeRO-3's all-gathers as its main thread issues them and waits for them, in order, over the steps of ``exp``."""
    from minizero.stages.zero3 import ZeRO3
    log, original = [], ZeRO3.all_gather

    def all_gather(self, unit, why):
        log.append(f"issue {unit.index}")
        work = original(self, unit, why)
        result = work.result
        work.result = lambda: log.append(f"wait {unit.index}") or result()
        return work
    ZeRO3.all_gather = all_gather  # (before the stage is built: its units hold the bound method)
    try:
        train_here(me, exp, after_step=lambda: log.append("step"))
    finally:
        ZeRO3.all_gather = original
    return log


def test_zero3_queues_the_prefetch_before_it_waits_for_a_prefetched_unit(pools):
    """The root (unit 0) and four blocks, prefetch 1.  A unit whose all-gather is already on its way when its moment
    comes has the next unit's queued *before* this rank waits, so the two run back to back on the wire (FSDP2's host
    never waits for a gather; here the wait is the host's).  A unit gathered on the spot (the first of each pass) is
    waited for first: its prefetch would otherwise take the wire ahead of nothing.  Only speed depends on this order
    (the efficiency bench: zero3 0.86 against 0.93), so it is held here, call by call, on every rank and step."""
    from minizero.course.harness.experiment import Experiment
    exp = Experiment(stage="zero3", task="gpt", model={"n_layer": 4}, steps=2, dtype="float32", optimizer="sgd",
                     check=False, options={"prefetch": 1})
    forward = ["issue 0", "wait 0", "issue 1", "issue 2", "wait 1", "issue 3", "wait 2", "issue 4", "wait 3", "wait 4"]
    backward = ["issue 0", "wait 0", "issue 4", "wait 4", "issue 3", "issue 2", "wait 3", "issue 1", "wait 2", "wait 1"]
    for rank, log in enumerate(pools.run(2, _gathers_in_order, exp)):
        assert log == (forward + backward + ["step"]) * exp.steps, (rank, log)

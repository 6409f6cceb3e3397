"""The communication thread's two promises that no result shows: a function it runs may wait for a collective it
issued itself, and a function that has run is let go before anyone hears it is done."""
from __future__ import annotations

import threading
import weakref

import pytest
import torch

from minizero.comm.thread import CommThread
from minizero.run.launch import RankPool


def test_a_function_the_thread_runs_may_wait_for_what_it_submits():
    """Queued behind its caller, a function submitted from the thread would never run while the caller waits for it:
    a hang with no collective in flight, which no stall verdict sees.  It runs at once instead, as a blocking
    collective called there does -- before whatever the main thread queued after its caller."""
    thread, order = CommThread("test-comm"), []
    try:
        def caller():
            order.append("caller")
            inner = thread.submit(lambda: order.append("inner") or "inner's result")
            return inner.result()
        first = thread.submit(caller)
        after = thread.submit(lambda: order.append("queued after"))
        assert first._future.result(timeout=10) == "inner's result"  # (a timeout: a failure, not a hang)
        after._future.result(timeout=10)
        assert order == ["caller", "inner", "queued after"]
    finally:
        thread.stop()  # (not close: a thread stuck in the caller would never be joined)


def _waits_inside_the_thread(me, network):
    from minizero.comm import make_comm
    comm, waits = make_comm("ring", network=network), []
    comm.add_span_observer(lambda call, start, end, thread: call is None and waits.append(thread))
    try:
        tensor = torch.full((6,), float(me.rank + 1))

        def reduce_and_wait():  # an async_op collective issued and waited for where the thread runs it
            comm.all_reduce(tensor, async_op=True).wait()
            return tensor.clone()
        return comm.submit(reduce_and_wait).result(), waits
    finally:
        comm.close()


@pytest.mark.parametrize("network", [None, "alpha=1ms,bandwidth=1GB/s"])
def test_an_async_collective_waited_for_on_the_thread_completes(network):
    """The same through a Comm, undialled and dialled (where ``async_op`` returns a wait until the wire is done).  A
    wait there is the thread's, not the host's: a timeline that drew it would take it off the main thread's compute,
    so only the main thread's own wait is observed."""
    with RankPool(3, timeout_s=8) as pool:
        results = pool.run_within(20, _waits_inside_the_thread, network)  # a hang ends as a failure
    for rank, (result, waits) in enumerate(results):
        assert torch.equal(result, torch.full((6,), 6.0)), (rank, result)
        assert set(waits) <= {"MainThread"}, (rank, waits)


def test_a_function_is_let_go_before_its_work_is_done():
    """ZeRO-2's launched bucket holds its packed full gradients in the function's closure: they must be freed when its
    reduce-scatter ends, not when the thread takes the next task -- nor when the next bucket is launched."""
    thread, gate, seen = CommThread("test-comm"), threading.Event(), {}

    class Packed:
        pass
    try:
        packed = Packed()
        held = weakref.ref(packed)

        def reduce_scatter(packed=packed):
            gate.wait()
            return len(vars(packed))
        del packed
        work = thread.submit(reduce_scatter)
        del reduce_scatter
        work._future.add_done_callback(lambda _: seen.update(alive=held() is not None))
        gate.set()
        work._future.result(timeout=10)
        assert seen == {"alive": False}, "the function's closure outlived the moment its work was done"
    finally:
        thread.close()

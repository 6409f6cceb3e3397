"""The launcher: failures reach the caller, naming the rank; nothing hangs."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time

import pytest
import torch

from minizero.comm import make_comm
from minizero.run.launch import RankError, RankPool, run


def _raise_on_rank_1(me):
    if me.rank == 1:
        raise ValueError("deliberate failure")
    make_comm("ring").all_reduce(torch.ones(4))  # rank 0 and 2 wait for rank 1


def _die_on_rank_2(me):
    if me.rank == 2:
        os._exit(7)
    make_comm("ring").all_reduce(torch.ones(4))


def _stall_on_rank_0(me):
    if me.rank == 0:
        time.sleep(60)
    make_comm("ring").all_reduce(torch.ones(4))


def _whoami(me, offset):
    return me.rank + offset, me.world_size


def test_results_come_back_in_rank_order():
    assert run(_whoami, 3, 10) == [(10, 3), (11, 3), (12, 3)]


def test_exception_names_rank_and_carries_traceback():
    start = time.monotonic()
    with pytest.raises(RankError, match="rank 1 raised") as info:
        run(_raise_on_rank_1, 3)
    assert info.value.rank == 1 and "deliberate failure" in info.value.remote_traceback
    assert time.monotonic() - start < 20


def test_dead_rank_ends_the_run():
    start = time.monotonic()
    with pytest.raises(RankError, match="rank 2 died with exit code 7"):
        run(_die_on_rank_2, 3)
    assert time.monotonic() - start < 20


def test_stall_names_the_rank_that_stopped_not_the_one_that_waits():
    """Rank 1 waits in the all-reduce; rank 0 sleeps outside any collective.  The parent reads
    both rows of the progress board and blames rank 0, after the timeout, not the run's length."""
    start = time.monotonic()
    with pytest.raises(RankError) as info:
        run(_stall_on_rank_0, 2, timeout_s=2)
    message = str(info.value)
    assert "Stopped making progress: rank 0 -- it is in no collective" in message
    assert "stalled: rank 1 has made no progress" in message and "all_reduce #1 of 4 elements" in message
    assert "rank 1: in all_reduce #1" in message and "waiting for rank 0" in message
    assert info.value.rank == 0
    assert time.monotonic() - start < 12


def _compute_then_reduce(me, seconds):
    time.sleep(seconds)  # long work outside any collective, on every rank
    t = torch.ones(3)
    make_comm("ring").all_reduce(t)
    return t.tolist()


def test_long_work_outside_collectives_is_not_a_stall():
    """The clock runs only while a collective waits: 2 s of work with a 1 s timeout completes."""
    assert run(_compute_then_reduce, 2, 2.0, timeout_s=1) == [[2.0] * 3] * 2


def _many_short_collectives(me, calls):
    comm, t, start = make_comm("ring", check=True), torch.ones(64), time.monotonic()
    for _ in range(calls):
        time.sleep(0.04)  # a little work between collectives, as in training
        comm.all_reduce(t.fill_(1.0))
    return time.monotonic() - start


def test_a_healthy_run_longer_than_the_timeout_completes():
    """timeout_s bounds a stall, not a run: 4 s of collectives under a 1 s timeout."""
    assert min(run(_many_short_collectives, 2, 100, timeout_s=1)) > 4


def test_pool_refuses_after_failure_and_runs_many_tasks():
    pool = RankPool(2, timeout_s=30)
    for i in range(20):
        assert pool.run(_whoami, i) == [(i, 2), (i + 1, 2)]
    with pytest.raises(RankError):
        pool.run(_raise_on_rank_1)  # rank 1 of 2: rank 0 waits, the pool is stopped
    with pytest.raises(RankError, match="shut down"):
        pool.run(_whoami, 0)


_RETURNED = []  # weak references to what a task returned, on each rank


def _return_a_tensor(me):
    import weakref
    result = torch.zeros(4)
    _RETURNED.append(weakref.ref(result))
    return result


def _is_the_last_result_alive(me):
    return _RETURNED[-1]() is not None


def test_a_rank_keeps_nothing_of_a_task_once_its_result_is_sent():
    """A rank that held its last result while running the next task kept its tensors -- on a GPU, allocated memory
    that the next task's CUDA peaks counted as its own (issue 31)."""
    with RankPool(2, timeout_s=30) as pool:
        pool.run(_return_a_tensor)
        assert pool.run(_is_the_last_result_alive) == [False, False]


def _unpicklable(me):
    return lambda: me.rank  # a lambda cannot travel back to the caller


def test_a_result_that_cannot_travel_back_is_named():
    with pytest.raises(RankError, match="rank [01]: result is not picklable"):
        run(_unpicklable, 2)


@pytest.mark.parametrize("bad", [0, -1, 1.5])
def test_world_size_below_one_is_refused(bad):
    with pytest.raises(ValueError, match="world_size must be an integer >= 1"):
        RankPool(bad)


def test_function_defined_in_main_runs_with_fork(tmp_path):
    """What a notebook does: the function lives in __main__, not in a module."""
    script = tmp_path / "script.py"
    script.write_text(textwrap.dedent("""
        import torch
        from minizero.run.launch import run
        from minizero.comm import make_comm, ReduceOp
        def f(me):
            t = torch.tensor([float(me.rank)])
            make_comm("ring").all_reduce(t, ReduceOp.SUM)
            return t.item()
        print(run(f, 3))
    """))
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "[3.0, 3.0, 3.0]" in out.stdout


def test_same_code_runs_under_torchrun(under_torchrun):
    """env:// rendezvous: `python -m minizero compare` unchanged under torchrun (--standalone picks a free
    port).  The header reports the ranks that really ran (2), not --world-size (3), and --timeout reaches
    the ranks.  (The launch is shared with `train`'s test, tests/test_train_command.py: conftest.py.)"""
    out = under_torchrun
    assert out.returncode == 0, out.stdout + out.stderr
    assert "N=2," in out.section("compare"), out.stdout
    assert out.stdout.count("ddp ") == 1 and out.stdout.count(" yes ") == 2, out.stdout  # only rank 0 prints


def _slow_but_moving(me, pause_s):
    comm = make_comm("ring")
    comm.add_observer(lambda kind, nbytes: time.sleep(pause_s))  # every message takes a while to leave
    t = torch.ones(3 * 64)
    comm.all_reduce(t)  # 2(N-1) = 4 messages per rank at N=3
    return t[0].item()


def test_a_slow_collective_that_keeps_moving_is_not_a_stall():
    """Each ring step takes 0.5 s, the whole all-reduce about 2 s, the timeout is 1.2 s: the clock
    restarts at every step's progress, so it completes."""
    assert run(_slow_but_moving, 3, 0.5, timeout_s=1.2) == [3.0] * 3


def _a_send_that_never_happens(me):
    """Rank 1's all-gather step forgets to send (a bug inside the collective), then rank 1 goes quiet."""
    comm = make_comm("ring")
    if me.rank == 1:
        step = comm._send_right_recv_left
        comm._send_right_recv_left = lambda send, recv, part, i: step(None if part == "all-gather" else send,
                                                                        recv, part, i)
    comm.all_reduce(torch.ones(4))
    if me.rank == 1:
        time.sleep(60)


def test_a_ring_step_whose_message_never_comes_is_reported_as_that():
    with pytest.raises(RankError) as info:
        run(_a_send_that_never_happens, 2, timeout_s=2)
    message = str(info.value)
    assert "Stopped making progress: rank 1 -- it already left collective #1 without sending the message" in message
    assert "rank 0 waits for: a bug inside the collective, not a disagreement" in message
    assert "rank 0: in all_reduce #1 of 4 elements, in its all-gather step 1, waiting for rank 1" in message


def _where(me):
    return me.rank, me.world_size


def test_a_spawned_pool_starts(tmp_path):
    """``spawn`` -- what a CUDA pool uses, since CUDA cannot be used in a forked child -- pickles the
    rendezvous port to each child; the pool must keep it alive until they have it."""
    with RankPool(2, start_method="spawn", timeout_s=60) as pool:
        assert pool.run(_where) == [(0, 2), (1, 2)]

"""The launcher: failures reach the caller, naming the rank; nothing hangs."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time

import pytest
import torch

from minizero.comm import ReduceOp, make_comm
from minizero.launch import RankError, RankPool, run


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


def _sleep_on_rank_0(me):
    if me.rank == 0:
        time.sleep(60)


def test_stall_inside_a_collective_is_reported_by_the_waiting_peer():
    start = time.monotonic()
    with pytest.raises(RankError, match="(?s)rank 1 raised.*Timed out"):
        run(_stall_on_rank_0, 2, timeout_s=3)
    assert time.monotonic() - start < 15


def test_stall_outside_any_collective_ends_at_the_deadline():
    start = time.monotonic()
    with pytest.raises(RankError, match=r"ranks \[0\] did not finish within the timeout"):
        run(_sleep_on_rank_0, 2, timeout_s=2)
    assert time.monotonic() - start < 15


def test_pool_refuses_after_failure_and_runs_many_tasks():
    pool = RankPool(2, timeout_s=30)
    for i in range(20):
        assert pool.run(_whoami, i) == [(i, 2), (i + 1, 2)]
    with pytest.raises(RankError):
        pool.run(_raise_on_rank_1)  # rank 1 of 2: rank 0 waits, the pool is stopped
    with pytest.raises(RankError, match="shut down"):
        pool.run(_whoami, 0)


@pytest.mark.parametrize("bad", [0, -1, 1.5])
def test_world_size_below_one_is_refused(bad):
    with pytest.raises(ValueError, match="world_size must be an integer >= 1"):
        RankPool(bad)


def test_function_defined_in_main_runs_with_fork(tmp_path):
    """What a notebook does: the function lives in __main__, not in a module."""
    script = tmp_path / "script.py"
    script.write_text(textwrap.dedent("""
        import torch
        from minizero.launch import run
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


def test_same_code_runs_under_torchrun(tmp_path):
    """env:// rendezvous: `python -m minizero compare` unchanged under torchrun (--standalone picks a free port)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           "-m", "minizero", "compare", "--stages", "ddp", "--steps", "2", "--task", "mlp", "--json"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert out.returncode == 0, out.stdout + out.stderr
    assert '"within_tolerance": true' in out.stdout
    assert out.stdout.count('"stage": "ddp"') == 1  # only rank 0 prints

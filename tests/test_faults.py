"""A failing or stalled rank ends the whole run with an error naming it -- never a hang.

Four ways to fail (raise, os._exit, SIGKILL, sleep) at three places (forward, in the middle of a
bucket's all-reduce, in the middle of a ZeRO-3 all-gather), on a local pool and under torchrun.
Every other rank is stopped within the timeout, and the error names rank 1, the one that failed.
"""
from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from minizero.launch import RankError, RankPool
from tests.faults import FAULTS, FAULTY_RANK, PLACES, train_with_fault

TIMEOUT_S = 2.0

#: What the caller is told, per way of failing.
VERDICT = {"raise": "rank 1 raised:", "exit": "rank 1 died with exit code 3",
           "kill": "rank 1 died with exit code -9",
           "sleep": "Stopped making progress: rank 1 -- it is"}


@pytest.mark.parametrize("place", PLACES)
@pytest.mark.parametrize("fault", FAULTS)
def test_a_failed_rank_ends_the_run_naming_it(fault, place):
    start = time.monotonic()
    with RankPool(2, timeout_s=TIMEOUT_S) as pool:
        with pytest.raises(RankError) as info:
            pool.run(train_with_fault, fault, place)
    elapsed = time.monotonic() - start
    message = str(info.value)
    assert VERDICT[fault] in message, message
    assert info.value.rank == FAULTY_RANK
    if fault == "raise":
        assert "injected fault" in info.value.remote_traceback
    if fault == "sleep":  # the stall names the collective the other rank waits in -- or, when the sleeper's
        # own clock runs out first (their last progress is microseconds apart), the sleeper itself
        assert ("stalled: rank 0 has made no progress" in message and "waiting for rank 1" in message) or \
            "stalled: rank 1 has made no progress" in message, message
        assert ("in no collective" if place == "forward" else "inside the collective but not waiting") in message
    assert elapsed < TIMEOUT_S + 12, elapsed  # pool start-up, the faulty step, the timeout


def test_three_ranks_a_stall_in_a_ring_step_is_traced_to_the_rank_that_stopped():
    """Rank 2 waits on rank 1 (its left neighbour), rank 0 on rank 2: the verdict follows the arrows."""
    with RankPool(3, timeout_s=TIMEOUT_S) as pool:
        with pytest.raises(RankError) as info:
            pool.run(train_with_fault, "sleep", "bucket")
    assert "Stopped making progress: rank 1 -- it is inside the collective but not waiting" in str(info.value)


# Under torchrun a killed rank and one that raised both end as an exiting process, which torchrun's agent
# sees the same way: the raise stands for both (the local pool's tests kill ranks too).
TORCHRUN = [("raise", "bucket"), ("sleep", "gather")]


@pytest.mark.parametrize("fault, place", TORCHRUN)
def test_under_torchrun_a_failed_rank_ends_every_rank(fault, place):
    """torchrun stops the others once one rank exits.  A sleeping rank is named by a watchdog -- the
    waiting rank's, or, when it sleeps inside a collective, its own -- which then ends its process:
    the whole job ends, bounded by the timeout."""
    script = Path(__file__).with_name("faults.py")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           str(script), fault, place, str(TIMEOUT_S)]
    start = time.monotonic()
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=120,
                         env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(script.parent.parent)})
    elapsed = time.monotonic() - start
    text = out.stdout + out.stderr
    assert out.returncode != 0, text
    assert "finished" not in out.stdout
    if fault == "sleep":
        assert "[minizero watchdog, rank" in text and "Stopped making progress: rank 1 --" in text, text
    else:
        assert "injected fault" in text and "rank      : 1" in text, text
    assert elapsed < 60, elapsed

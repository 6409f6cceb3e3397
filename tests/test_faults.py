"""A failing or stalled rank ends the whole run with an error naming it -- never a hang.

Five ways to fail (raise, os._exit, SIGKILL, sleep, SIGSTOP) at three places (forward, in the middle of a
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

from minizero.run.launch import RankError, RankPool
from tests.faults import FAULTS, FAULTY_RANK, PLACES, train_with_fault

TIMEOUT_S = 2.0

#: What the caller is told, per way of failing.
VERDICT = {"raise": "rank 1 raised:", "exit": "rank 1 died with exit code 3",
           "kill": "rank 1 died with exit code -9",
           "sleep": "Stopped making progress: rank 1 -- it is",
           "stop": "Stopped making progress: rank 1 -- its process is frozen: its heartbeat has stopped"}


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
    if fault == "stop":
        assert_frozen_rank_1_named(message, place)
    assert elapsed < TIMEOUT_S + 12, elapsed  # pool start-up, the faulty step, the timeout


def assert_frozen_rank_1_named(message: str, place: str) -> None:
    """A SIGSTOPped rank 1: named, and its row shown as frozen where it was -- mid-collective, waiting for a
    peer like the others (ring: for rank 0; torch's collective: for any), or in no collective (forward)."""
    assert "the OS says process" in message and "is stopped (SIGSTOP" in message, message
    frozen_row = message.split("rank 1: FROZEN: no heartbeat for ", 1)[1].split("\n", 1)[0]
    # Mid-collective, the freezing thread sees rank 1 waiting and sends SIGSTOP; on torch's collectives the
    # wait can end in the microseconds between, and rank 1 freezes just after it: named all the same.
    assert ("in no collective" in frozen_row if place == "forward" else
            "waiting for rank 0" in frozen_row or "waiting for any peer" in frozen_row or
            "in no collective" in frozen_row), message


@pytest.mark.parametrize("place", ["bucket", "gather"])
def test_a_rank_frozen_mid_collective_on_the_native_backend_is_named(place):
    """torch's own collectives: every rank in one waits for "any peer", so only the heartbeat can tell the
    frozen rank from the ranks that wait for it (the arrows alone said "no single rank")."""
    start = time.monotonic()
    with RankPool(2, timeout_s=TIMEOUT_S) as pool:
        with pytest.raises(RankError) as info:
            pool.run(train_with_fault, "stop", place, backend="native")
    message = str(info.value)
    assert VERDICT["stop"] in message and info.value.rank == FAULTY_RANK, message
    assert_frozen_rank_1_named(message, place)
    assert time.monotonic() - start < TIMEOUT_S + 15


def test_three_ranks_a_stall_in_a_ring_step_is_traced_to_the_rank_that_stopped():
    """Rank 2 waits on rank 1 (its left neighbour), rank 0 on rank 2: the verdict follows the arrows."""
    with RankPool(3, timeout_s=TIMEOUT_S) as pool:
        with pytest.raises(RankError) as info:
            pool.run(train_with_fault, "sleep", "bucket")
    assert "Stopped making progress: rank 1 -- it is inside the collective but not waiting" in str(info.value)


# Under torchrun a killed rank and one that raised both end as an exiting process, which torchrun's agent
# sees the same way: the raise stands for both (the local pool's tests kill ranks too).
TORCHRUN = [("raise", "bucket"), ("sleep", "gather"), ("stop", "bucket")]


@pytest.mark.parametrize("fault, place", TORCHRUN)
def test_under_torchrun_a_failed_rank_ends_every_rank(fault, place):
    """torchrun stops the others once one rank exits.  A sleeping rank is named by a watchdog -- the
    waiting rank's, or, when it sleeps inside a collective, its own -- which then ends its process:
    the whole job ends, bounded by the timeout.  A frozen rank (SIGSTOP, in torch's collective) cannot
    end itself, nor heed torchrun's SIGTERM: the watchdog that names it ends it, so torchrun's root cause
    is the frozen rank and the job ends soon after the timeout (it took 51 s, naming rank 0)."""
    script = Path(__file__).with_name("faults.py")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           str(script), fault, place, str(TIMEOUT_S), *(["native"] if fault == "stop" else [])]
    start = time.monotonic()
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300,
                         env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(script.parent.parent)})
    elapsed = time.monotonic() - start
    text = out.stdout + out.stderr
    assert out.returncode != 0, text
    assert "finished" not in out.stdout
    if fault == "sleep":
        assert "[minizero watchdog, rank" in text and "Stopped making progress: rank 1 --" in text, text
    elif fault == "stop":
        assert "[minizero watchdog, rank 0]" in text and VERDICT["stop"] in text, text
        assert "Ending frozen rank 1 (it cannot end itself) and this rank" in text, text
        assert_frozen_rank_1_named(text, place)
        root_cause = text.split("Root Cause", 1)[1]
        assert "rank      : 1" in root_cause and "exitcode  : -9" in root_cause, text
        froze_at = float(text.split("rank 1 freezes at ", 1)[1].split()[0])
        assert time.time() - froze_at < TIMEOUT_S + 25, text  # the timeout, the watchdog's tick, torchrun's exit
    else:
        assert "injected fault" in text and "rank      : 1" in text, text
    # Bounded, not fast: alone it ends in ~20 s; a busy 2-core machine (load 30+) took 64 s, and a hang would
    # run into the subprocess's own limit.
    assert elapsed < 150, elapsed


def _abort_on_rank_1(me):
    if me.rank == FAULTY_RANK:
        os.abort()  # what gloo does to a rank whose peer broke the connection
    time.sleep(30)


def test_a_rank_killed_by_a_signal_leaves_its_stack_in_the_error_not_on_the_terminal(capfd):
    """Deliberately broken collectives make gloo abort ranks: their fatal-signal stacks go to the RankError, so the
    suite's output holds pytest's lines, not pages of thread dumps."""
    with RankPool(2, timeout_s=TIMEOUT_S) as pool:
        with pytest.raises(RankError) as info:
            pool.run(_abort_on_rank_1)
    message = str(info.value)
    assert "rank 1 died with exit code -6" in message and "Its Python stack when it died" in message, message
    assert "_abort_on_rank_1" in message, message
    assert "Fatal Python error" not in capfd.readouterr().err


def _encode_breaks_on_rank_1(me, stage_name: str, compress: str) -> None:
    """A small model trained two steps; rank 1's wire raises in its third encode -- on the communication thread,
    before that bucket's collective, which its peers are already inside."""
    import torch

    from minizero.comm import make_comm
    from minizero.course.harness.models import MLP
    from minizero.stages import make_stage
    model = MLP((4, 8, 8, 2), seed=0, dtype=torch.float32)
    stage = make_stage(stage_name, model, torch.optim.SGD(model.parameters(), lr=0.1), make_comm("ring"),
                       compress=compress, bucket_mb=1e-9)
    if me.rank == FAULTY_RANK:
        coder = getattr(stage.wire, "codec", stage.wire)  # a codec's, or the 16-bit wire's own
        encode, calls = coder.encode, []

        def breaks(*args, **kwargs):
            calls.append(1)
            if len(calls) == 3:
                raise ValueError("rank 1's encode broke")
            return encode(*args, **kwargs)
        coder.encode = breaks
    for step in range(2):
        stage.zero_grad()
        stage(torch.ones(4, 4) * (me.rank + step)).pow(2).mean().backward()
        stage.step()


@pytest.mark.parametrize("stage, compress", [("zero2", "topk:0.5"), ("zero2", "fp16"), ("ddp-bucketed", "int8")])
def test_a_wire_that_raises_on_one_rank_ends_the_run_naming_that_rank_and_its_error(stage, compress):
    """Once, the raising rank's next bucket paired with its peer's pending one (gloo: "Received data size doesn't
    match expected size", the process aborted, the error lost; or rank 0 blamed).  Its Comm now takes no more
    collectives after a wire's steps failed part-way, so the error it raised is the one reported."""
    with RankPool(2, timeout_s=TIMEOUT_S) as pool:
        with pytest.raises(RankError) as info:
            pool.run(_encode_breaks_on_rank_1, stage, compress)
    assert "rank 1 raised:" in str(info.value) and info.value.rank == FAULTY_RANK, str(info.value)
    assert "ValueError: rank 1's encode broke" in info.value.remote_traceback, info.value.remote_traceback

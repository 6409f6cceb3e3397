"""The stall verdict on boards written by hand: every arrow case, without starting a process."""
from __future__ import annotations

import os
import time

from minizero.comm.progress import ANYONE, FIELDS, IDLE, IN_COLLECTIVE, NOBODY, PARTS
from minizero.comm.stall import stalled

NOW = time.time()


def row(rank, state, seq, waiting_on=NOBODY, progress=NOW - 10, kind=0):
    values = {name: 0.0 for name in FIELDS}
    values.update(state=state, seq=float(seq), waiting_on=float(waiting_on), progress=progress, left=progress,
                  entered=progress, kind=float(kind), part=float(len(PARTS) - 1), step=-1.0, tag_step=-1.0,
                  tag_backward=-1.0, tag_syncing=-1.0)
    return {**values, "rank": rank, "what": "bucket 0"}


def test_a_broadcast_blames_only_the_rank_that_never_reached_it():
    """Ranks 0 and 1 passed their messages on and left #5; rank 2 waits for anyone upstream; rank 3 is
    still idle after #4.  Only rank 3 stopped."""
    records = [row(0, IDLE, 5), row(1, IDLE, 5), row(2, IN_COLLECTIVE, 5, ANYONE), row(3, IDLE, 4)]
    message, culprits = stalled(records, NOW, timeout_s=2)
    assert culprits == [3], message


def test_the_arrows_lead_through_waiting_ranks_to_the_one_that_is_busy():
    records = [row(0, IN_COLLECTIVE, 7, waiting_on=2), row(1, IN_COLLECTIVE, 7, waiting_on=NOBODY),
               row(2, IN_COLLECTIVE, 7, waiting_on=1)]
    message, culprits = stalled(records, NOW, timeout_s=2)
    assert culprits == [1] and "busy or stuck in its own code" in message


def test_a_cycle_of_waiting_ranks_is_a_deadlock_inside_the_collective():
    records = [row(0, IN_COLLECTIVE, 7, waiting_on=1), row(1, IN_COLLECTIVE, 7, waiting_on=0)]
    message, culprits = stalled(records, NOW, timeout_s=2)
    assert culprits == [] and "a deadlock inside the collective" in message


def test_a_rank_that_never_reported_is_named_and_progress_within_the_timeout_is_no_stall():
    assert stalled([row(0, IN_COLLECTIVE, 1, waiting_on=1), None], NOW, timeout_s=2)[1] == [1]
    assert stalled([row(0, IN_COLLECTIVE, 1, waiting_on=1, progress=NOW - 1), None], NOW, timeout_s=2) is None


class _StoreGone:
    def set(self, key, value):
        raise RuntimeError("connection reset")

    def check(self, keys):
        raise RuntimeError("connection reset")


def test_the_torchrun_watchdog_judges_on_its_own_row_when_the_store_is_gone():
    import torch

    from minizero.comm.fingerprint import Call, Tag
    from minizero.comm.progress import ProgressBoard
    from minizero.run.torchrun import Watchdog

    board = ProgressBoard(0)
    watchdog = Watchdog(board, _StoreGone(), world_size=2, timeout_s=0.05)
    assert watchdog.tick() is None  # idle: nothing to judge, and the failing store raised nothing
    board.enter(Call(1, "all_reduce", 4, torch.float32, "sum", Tag("bucket 0")))
    with board.waiting_for(1):
        time.sleep(0.1)
        verdict = watchdog.tick()
    assert verdict is not None and "Stopped making progress: rank 1 -- it never reported progress" in verdict


# ---------------------------------------------------------------- a frozen rank (SIGSTOP): its heartbeat stops
def beating(record, age=0.05):
    """``record`` with a heartbeat ``age`` seconds old (a live rank's: a fraction of a second)."""
    return {**record, "heartbeat": NOW - age}


def test_a_frozen_rank_in_a_cycle_of_waits_is_named_not_a_deadlock():
    """The ring, rank 1 stopped while it waited for rank 0: both rows wait for each other, as in a deadlock --
    but rank 1's heartbeat stopped when it froze, 10 s ago."""
    records = [beating(row(0, IN_COLLECTIVE, 7, waiting_on=1)), beating(row(1, IN_COLLECTIVE, 7, waiting_on=0), age=10)]
    message, culprits = stalled(records, NOW, timeout_s=2)
    assert culprits == [1], message
    assert "Stopped making progress: rank 1 -- its process is frozen: its heartbeat has stopped" in message
    assert "rank 1: FROZEN: no heartbeat for 10.0 s; its row, from then: in all_reduce #7" in message
    assert "deadlock" not in message


def test_a_frozen_rank_in_a_torch_collective_is_named_not_no_single_rank():
    """torch's collective: every rank waits for any peer, in the same collective -- the arrows name nobody."""
    records = [beating(row(0, IN_COLLECTIVE, 7, waiting_on=ANYONE)),
               beating(row(1, IN_COLLECTIVE, 7, waiting_on=ANYONE), age=10)]
    assert stalled([beating(r) for r in records], NOW, timeout_s=2)[1] == []  # all alive: no single rank
    message, culprits = stalled(records, NOW, timeout_s=2)
    assert culprits == [1] and "rank 1 -- its process is frozen" in message, message


def test_live_heartbeats_leave_the_verdict_to_the_arrows_and_a_late_one_defers_it():
    records = [beating(row(0, IN_COLLECTIVE, 7, waiting_on=1)), beating(row(1, IN_COLLECTIVE, 7))]
    message, culprits = stalled(records, NOW, timeout_s=2)
    assert culprits == [1] and "busy or stuck in its own code" in message and "FROZEN" not in message
    # half a second without a beat: frozen, or not scheduled on a busy machine -- the next look decides
    assert stalled([records[0], beating(records[1], age=0.5)], NOW, timeout_s=2) is None
    # a rank with no heartbeat at all (none was ever started) is judged by its arrows alone
    assert stalled([records[0], records[1] | {"heartbeat": 0.0}], NOW, timeout_s=2)[1] == [1]


def test_a_stale_heartbeat_never_displaces_a_live_rank_the_arrows_name():
    """Rank 1 sleeps in its own code (the arrows name it); rank 2, healthy and waiting, was not scheduled for
    two seconds on a busy machine: the verdict stays rank 1's, with rank 2 marked beneath."""
    records = [beating(row(0, IN_COLLECTIVE, 7, waiting_on=1)), beating(row(1, IDLE, 6)),
               beating(row(2, IN_COLLECTIVE, 7, waiting_on=0), age=2)]
    message, culprits = stalled(records, NOW, timeout_s=2)
    assert culprits == [1] and "rank 1 -- it is in no collective" in message, message
    assert "rank 2: FROZEN" in message


def test_a_frozen_rank_s_stale_arrow_is_not_followed():
    """Rank 1 froze in collective #7 waiting for rank 0, which has since moved on to #8 and waits for rank 1:
    followed from rank 1's stale row, the arrows would blame rank 0 for leaving #7 early."""
    records = [beating(row(0, IN_COLLECTIVE, 8, waiting_on=1)),
               beating(row(1, IN_COLLECTIVE, 7, waiting_on=0, progress=NOW - 12), age=12)]
    message, culprits = stalled(records, NOW, timeout_s=2)
    assert culprits == [1] and "rank 1 -- its process is frozen" in message, message


def test_the_os_state_of_a_stopped_process_is_reported():
    import signal
    import subprocess
    import sys

    from minizero.comm.stall import process_state

    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        os.kill(child.pid, signal.SIGSTOP)
        deadline = time.monotonic() + 30
        while "stopped" not in process_state({"pid": child.pid}) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert process_state({"pid": child.pid}).startswith(f"the OS says process {child.pid} is stopped (SIGSTOP")
        assert process_state({"pid": child.pid, "host": "another-host"}) == ""  # not ours to look up
    finally:
        child.kill()
        child.wait()


def test_the_deadline_outside_collectives_counts_from_when_the_rank_took_the_task():
    """The checker's deadline (minizero.run.stacks): submitted 10 s ago, idle since -- but a rank that was still
    joining its group took the task up only 2 s ago: not late yet."""
    from minizero.run.stacks import outside_collectives
    idle = row(0, IDLE, 3, progress=NOW - 20)
    assert outside_collectives([idle], NOW, started=NOW - 10, idle_s=5, finished=set())[1] == [0]
    assert outside_collectives([idle | {"task": NOW - 2}], NOW, started=NOW - 10, idle_s=5, finished=set()) is None

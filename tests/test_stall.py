"""The stall verdict on boards written by hand: every arrow case, without starting a process."""
from __future__ import annotations

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
    """Ranks 0 and 1 passed their pieces on and left #5; rank 2 waits for anyone upstream; rank 3 is
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
    from minizero.torchrun import Watchdog

    board = ProgressBoard(0)
    watchdog = Watchdog(board, _StoreGone(), world_size=2, timeout_s=0.05)
    assert watchdog.tick() is None  # idle: nothing to judge, and the failing store raised nothing
    board.enter(Call(1, "all_reduce", 4, torch.float32, "sum", Tag("bucket 0")))
    with board.waiting_for(1):
        time.sleep(0.1)
        verdict = watchdog.tick()
    assert verdict is not None and "Stopped making progress: rank 1 -- it never reported progress" in verdict

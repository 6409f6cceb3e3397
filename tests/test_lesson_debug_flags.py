"""Lesson 11's waits-for picture is drawn from the board: its arrows and its culprit are the watchdog's, not typed.

No processes: a board of four rows as the stall in the lesson leaves it (rank 1 in no collective, ranks 0 and 2
waiting for it, rank 3 waiting for rank 2), built with the board's own writer."""
from __future__ import annotations

import time

import torch

from minizero.comm.fingerprint import Call, Tag
from minizero.comm.progress import ProgressBoard
from minizero.course.figures import waits_for


def _board(now: float) -> list[dict]:
    rows = []
    for rank, waits in ((0, 1), (1, None), (2, 1), (3, 2)):
        board = ProgressBoard(rank)
        board.beat()
        if waits is not None:
            board.enter(Call(seq=4, kind="all_reduce", numel=20, dtype=torch.float32, op="avg", tag=Tag()))
            board.at("fingerprint exchange", 0)
            board._set(waiting_on=float(waits), progress=now - 5.0, heartbeat=now)
        else:
            board._set(left=now - 5.0, seq=3.0, heartbeat=now)
        rows.append(board.record())
    return rows


def test_arrows_and_culprit_come_from_the_board():
    now = time.time()
    board = _board(now)
    assert waits_for.arrows(board) == [(0, 1), (2, 1), (3, 2)]
    message, culprits = waits_for.verdict(board, now, timeout_s=2)
    assert culprits == [1] and "Stopped making progress: rank 1" in message


def test_the_picture_marks_the_rank_the_verdict_names():
    import matplotlib
    matplotlib.use("Agg")
    now = time.time()
    ax = waits_for.draw(_board(now), now, timeout_s=2)
    assert "rank 1" in ax.get_title()
    assert len([t for t in ax.texts if t.get_text() == "waits for"]) == 3

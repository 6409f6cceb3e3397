"""Lesson 11's picture: the waits-for graph of a stall, drawn from the progress board.

A stall verdict is a walk along arrows ("rank a waits for rank b") to the rank
that is not there.  The text of the verdict lists every row; the picture shows
the walk.  Nothing here is typed by hand: the nodes and arrows are the rows the
ranks wrote on the board (:mod:`minizero.comm.progress`), and the rank drawn as
stopped is the one :func:`minizero.comm.stall.stalled` names when it reads the
same rows.
"""
from __future__ import annotations

import math
import threading
import time

from minizero.comm.fingerprint import KINDS
from minizero.comm.progress import ANYONE, IDLE, NOBODY, PARTS
from minizero.comm.stall import stalled
from minizero.run.launch import RankError, RankPool


def stall_and_board(world_size: int, fn, *args, timeout_s: float):
    """Run ``fn`` on ``world_size`` fresh ranks, as :func:`minizero.run.launch.run` does, and beside it read the
    board every 10 ms.  Returns the :class:`RankError` that ended the run (None if none did) and the first
    reading that :func:`stalled` -- the watchdog's own test -- calls a stall, with its time.  Once the run is
    stopped the ranks' rows change as they die, so the board is kept as the watchdog saw it, not read after."""
    pool = RankPool(world_size, timeout_s=timeout_s)
    seen, done = [], threading.Event()

    def look():
        while not done.is_set() and not seen:
            now, records = time.time(), pool.records()
            if stalled(records, now, timeout_s):
                seen.append((records, now))
            time.sleep(0.01)

    thread = threading.Thread(target=look, daemon=True)
    thread.start()
    error = None
    try:
        pool.run(fn, *args)
    except RankError as stopped:
        error = stopped
    finally:
        done.set()
        thread.join()
        pool.close(kill=True)
    records, now = seen[0] if seen else (None, None)
    return error, records, now


def arrows(records: list[dict]) -> list[tuple[int, int]]:
    """``(a, b)`` for every rank ``a`` blocked waiting for rank ``b``.  A rank that waits for *any* peer
    (torch's own collectives) gets an arrow to each rank outside the collective it is in."""
    out = []
    for row in records:
        wait = row["waiting_on"]
        if row["state"] == IDLE or wait == NOBODY:
            continue
        if wait == ANYONE:
            out += [(row["rank"], other["rank"]) for other in records
                    if other["rank"] != row["rank"] and (other["state"] == IDLE or other["seq"] != row["seq"])]
        else:
            out.append((row["rank"], int(wait)))
    return out


def verdict(records: list[dict], now: float, timeout_s: float) -> tuple[str, list[int]] | None:
    """The watchdog's verdict on these rows, read at ``now``: the function the launcher calls."""
    return stalled(records, now, timeout_s)


def _label(row: dict) -> str:
    """Two short lines: the rank, and where its row says it is."""
    if row["state"] == IDLE:
        return f"rank {row['rank']}\nin no collective\n(last: #{int(row['seq'])})"
    part = PARTS[int(row["part"])]
    step = f" step {int(row['step']) + 1}" if row["step"] >= 0 else ""
    return f"rank {row['rank']}\nin {KINDS[int(row['kind'])]} #{int(row['seq'])}\n{part}{step}"


def draw(records: list[dict], now: float, timeout_s: float, ax=None):
    """Ranks on a circle, an arrow from each waiting rank to the rank it waits for; the rank(s) the
    verdict names in red.  Returns the axes."""
    import matplotlib.pyplot as plt

    if ax is None:
        _, ax = plt.subplots(figsize=(8, 3.4))
    found = verdict(records, now, timeout_s)
    culprits = set(found[1]) if found else set()
    n = len(records)
    # Rank 0 at the top, the others clockwise, squashed to fit a wide figure.
    where = {row["rank"]: (2.2 * math.sin(2 * math.pi * row["rank"] / n), math.cos(2 * math.pi * row["rank"] / n))
             for row in records}
    for a, b in arrows(records):
        (xa, ya), (xb, yb) = where[a], where[b]
        # From a quarter of the way to three quarters: clear of both rank boxes.
        ax.annotate("", xy=(xa + 0.72 * (xb - xa), ya + 0.72 * (yb - ya)),
                    xytext=(xa + 0.28 * (xb - xa), ya + 0.28 * (yb - ya)),
                    arrowprops=dict(arrowstyle="-|>", lw=1.6, color="0.3", mutation_scale=16))
        ax.text((xa + xb) / 2, (ya + yb) / 2 + 0.12, "waits for", fontsize=7, color="0.3", ha="center")
    for row in records:
        stopped = row["rank"] in culprits
        ax.text(*where[row["rank"]], _label(row), ha="center", va="center", fontsize=8,
                bbox=dict(boxstyle="round,pad=0.5", fc="#f4cccc" if stopped else "#dbe8f6",
                          ec="#cc0000" if stopped else "#3d6fa8", lw=2 if stopped else 1))
    named = ", ".join(f"rank {c}" for c in sorted(culprits)) or "no single rank"
    ax.set_title(f"waits-for graph at the stall: the arrows end at {named}, which the verdict names", fontsize=9)
    ax.set_xlim(-3.2, 3.2)
    ax.set_ylim(-1.6, 1.6)
    ax.axis("off")
    return ax

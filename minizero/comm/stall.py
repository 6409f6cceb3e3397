"""Reading the progress board: is a collective stalled, and which rank stopped?

A rank blocked in a collective waits for a particular peer (the ring's left
neighbour) or for several at once (torch's own collectives).  Follow those
"waits for" arrows from a rank that waits for a peer, in the oldest stuck
collective:

* to a rank in no collective -- it is computing, stuck in its own code, or
  finished without joining: **that** rank stopped;
* to a rank inside the collective but not waiting for anybody -- it is busy or
  stuck in the middle of it (a sleep, a hung callback);
* to a rank that already left the collective -- it moved on without sending
  the message the first one waits for: a bug inside the collective;
* to a rank that waits in turn -- follow on; a cycle means every rank waits for
  its neighbour, a deadlock inside the collective.

But a *frozen* rank -- its process stopped by SIGSTOP, Ctrl-Z or a debugger --
cannot update its row: the arrows show where it was when it froze, waiting
like everybody else (an arrow of the cycle, or one more rank in a torch
collective that waits for all).  Its heartbeat (:mod:`.progress`) has stopped,
though, while every live rank's goes on: a rank whose heartbeat is older than
:func:`frozen_after` is named before any arrow is followed.  Where the
reader can see the rank's process (same host), the OS's word on it is added.

Every rank's row is printed beneath, so the reader can check the verdict.
"""
from __future__ import annotations

import socket

from .fingerprint import KINDS
from .progress import ANYONE, HEARTBEAT_S, IDLE, NOBODY, PARTS

#: A heartbeat this many seconds old means the rank is frozen: ten beats missed -- far beyond a busy
#: machine's scheduling delay, far below any sensible timeout.  Capped by half the timeout (see frozen_after).
FROZEN_S = 1.0
#: A heartbeat this late is not yet frozen, but may be: a verdict waits until it is one or the other.
LATE_S = 3 * HEARTBEAT_S

BUSY = "it is inside the collective but not waiting for any peer: busy or stuck in its own code"


def _where(row: dict) -> str:
    part = PARTS[int(row["part"])]
    step = f" step {int(row['step']) + 1}" if row["step"] >= 0 else ""
    tag = f" for {row['what']!r}" if row["what"] else ""
    phase = ""
    if row["tag_step"] >= 0:
        phase = f" (optimizer step {int(row['tag_step'])}, backward {int(row['tag_backward'])}"
        phase += ", synchronising)" if row["tag_syncing"] == 1 else ", inside no_sync())" if row["tag_syncing"] == 0 else ")"
    inside = f", in its {part}{step}" if part else ""
    return f"{KINDS[int(row['kind'])]} #{int(row['seq'])} of {int(row['numel'])} elements{tag}{phase}{inside}"


def frozen_after(timeout_s: float, lag_s: float = 0.0) -> float:
    """How old a heartbeat must be to call its rank frozen: :data:`FROZEN_S`, but at most half the timeout
    (so a rank frozen at the start of a stall is one when the timeout runs out), never under :data:`LATE_S`.
    ``lag_s``: how old a live rank's heartbeat can look to this reader (the torchrun watchdog reads rows
    published every ``lag_s``).  A heartbeat is its host's clock, like a row's progress: across nodes, the
    clocks must agree to well within a second (NTP does)."""
    return max(min(FROZEN_S, timeout_s / 2), LATE_S) + lag_s


def heartbeat_age(row: dict | None, now: float) -> float | None:
    """Seconds since the rank's last heartbeat; None if it never beat (no heartbeat thread: not judged)."""
    if row is None or not row.get("heartbeat"):
        return None
    return now - row["heartbeat"]


def _os_state(row: dict) -> str | None:
    """The OS's one-letter state of the rank's process (``T`` stopped, ``t`` traced...), ``"gone"``, or None
    where this reader cannot see it (not Linux, another host)."""
    pid = int(row.get("pid") or 0) if row else 0
    if pid <= 0 or row.get("host", socket.gethostname()) != socket.gethostname():
        return None
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]  # after "pid (name)": the name may hold spaces
    except FileNotFoundError:
        return "gone"
    except (OSError, IndexError):
        return None


def is_stopped(row: dict) -> bool:
    """Whether the OS says the rank's process is stopped (SIGSTOP, a debugger): the one a watchdog may kill
    by its pid -- never a pid that exited and may have been reused."""
    return _os_state(row) in ("T", "t")


def process_state(row: dict) -> str:
    """What the OS says of the rank's process, where this reader can see it (Linux, same host); else ''."""
    pid, state = int(row.get("pid") or 0), _os_state(row)
    if state is None:
        return ""
    if state == "gone":
        return f"the OS has no process {pid} any more: it exited"
    return {"T": f"the OS says process {pid} is stopped (SIGSTOP, SIGTSTP or Ctrl-Z): `kill -CONT {pid}` resumes it",
            "t": f"the OS says process {pid} is stopped by a debugger (traced)",
            "D": f"the OS says process {pid} is in uninterruptible sleep (waiting on a disk or a driver)",
            "Z": f"the OS says process {pid} has exited (a zombie)"}.get(
        state, f"the OS says process {pid} is running or sleeping (state {state}): native code that holds the GIL?")


def frozen(records: list[dict | None], now: float, timeout_s: float, lag_s: float = 0.0) -> list[int]:
    """The ranks whose heartbeat is older than :func:`frozen_after`: stopped, whatever their row says."""
    limit = frozen_after(timeout_s, lag_s)
    return [r for r, row in enumerate(records) if (heartbeat_age(row, now) or 0.0) > limit]


def describe(row: dict | None, now: float, finished: bool = False, is_frozen: bool = False) -> str:
    if row is None:
        return "no report (it never published its progress, or died)"
    if finished:
        return "finished its task"
    if is_frozen:
        return f"FROZEN: no heartbeat for {heartbeat_age(row, now):.1f} s; its row, from then: {describe(row, now)}"
    if row["state"] == IDLE:
        if row["seq"] < 0:
            return f"in no collective, and none yet since it started {now - row['left']:.1f} s ago"
        return (f"in no collective for {now - row['left']:.1f} s "
                f"(its last, #{int(row['seq'])} for {row['what']!r}, ended then; {int(row['collectives'])} so far)")
    wait = row["waiting_on"]
    waiting = ("not waiting for any peer" if wait == NOBODY else "waiting for any peer" if wait == ANYONE
               else f"waiting for rank {int(wait)}")
    return f"in {_where(row)}, {waiting}; last progress {now - row['progress']:.1f} s ago"


def stalled(records: list[dict | None], now: float, timeout_s: float, finished: set[int] = frozenset(),
            grace_s: float = 2.0, lag_s: float = 0.0) -> tuple[str, list[int]] | None:
    """``(message, culprit ranks)`` if some collective made no progress for ``timeout_s``, else None.

    A collective that waits, through the arrows, on a rank that already
    *finished its task* can never complete: it is reported after ``grace_s``.
    A frozen rank (:func:`frozen`; ``lag_s`` as there) is the culprit where the
    arrows name nobody or name it; while a rank's heartbeat is late but not yet
    overdue, the verdict waits for it to be one or the other."""
    waiting = [r for r in records if r is not None and r["state"] != IDLE]
    stopped = [r for r in frozen(records, now, timeout_s, lag_s) if r not in finished]
    for limit in (timeout_s, min(grace_s, timeout_s)):
        stuck = [r for r in waiting if now - r["progress"] > limit]
        if not stuck:
            continue
        # Tell it from the side of a live rank that waits for a peer, the oldest collective first: a frozen
        # rank's row is where it was when it froze, and its arrow may point at a peer that has since moved on.
        first = min([r for r in stuck if r["rank"] not in stopped] or stuck,
                    key=lambda r: (r["waiting_on"] == NOBODY, r["seq"], r["progress"]))
        culprits, reason = blame(first, records, finished, set(stopped))
        if limit == timeout_s or (culprits and set(culprits) <= set(finished)):
            if limit == timeout_s:
                # The heartbeat decides where the arrows name nobody (a cycle through the frozen rank, torch's
                # "any peer"); a live rank descheduled for a second never displaces a live rank they name.
                if stopped and (not culprits or set(culprits) <= set(stopped)):
                    culprits, reason = stopped, FROZEN
                elif not stopped and any(r not in finished and (heartbeat_age(row, now) or 0.0) > LATE_S + lag_s
                                         for r, row in enumerate(records)):
                    return None  # frozen, or just slow to be scheduled: the next look tells
            return explain(first, records, now, timeout_s, finished, culprits, reason, lag_s), culprits
    return None


FROZEN = ("its process is frozen: its heartbeat has stopped, so its row only says where it was when it "
          "froze (it cannot take part in any collective until it is resumed or ended)")


def blame(first: dict, records: list[dict | None], finished: set[int],
          stopped: set[int] = frozenset()) -> tuple[list[int], str]:
    """Follow the waits-for arrows from ``first``; return the ranks that stopped, and why.  An arrow to a
    ``stopped`` (frozen) rank ends there: its own arrow is stale."""
    row, seen = first, set()
    while True:
        seen.add(row["rank"])
        wait = row["waiting_on"]
        if wait == NOBODY:
            return [row["rank"]], BUSY
        if wait == ANYONE:
            # Not ranks that already left this collective (a broadcast's upstream), nor ranks ahead of it.
            behind = [r for r, other in enumerate(records)
                      if other is None or other["seq"] < row["seq"]
                      or (other["seq"] == row["seq"] and other["state"] != IDLE and other["waiting_on"] == NOBODY)]
            return behind, "the collective waits for several ranks at once, and these never reached it"
        peer = int(wait)
        other = records[peer] if 0 <= peer < len(records) else None
        if peer in stopped:
            return [peer], FROZEN
        if other is None:
            return [peer], "it never reported progress"
        if other["seq"] > row["seq"] or (other["seq"] == row["seq"] and other["state"] == IDLE):
            return [peer], (f"it already left collective #{int(row['seq'])} without sending the message rank "
                            f"{row['rank']} waits for: a bug inside the collective, not a disagreement")
        if peer in finished or other["state"] == IDLE:
            return [peer], ("it finished its task without joining this collective" if peer in finished else
                            "it is in no collective: computing, stuck in its own code, or it skipped this one")
        if other["waiting_on"] == NOBODY:
            return [peer], BUSY
        if peer in seen:
            return [], ("every rank in the chain waits for its neighbour: a message that should exist was never "
                        "sent -- a deadlock inside the collective")
        row = other


def explain(first: dict, records, now: float, timeout_s: float, finished, culprits: list[int], reason: str,
            lag_s: float = 0.0) -> str:
    who = ", ".join(f"rank {c}" for c in culprits) or "no single rank"
    lines = [f"stalled: rank {first['rank']} has made no progress for {now - first['progress']:.1f} s "
             f"(timeout {timeout_s:g} s) in {_where(first)}.",
             f"Stopped making progress: {who} -- {reason}."]
    stopped = frozen(records, now, timeout_s, lag_s)
    lines += [f"  rank {r}: {process_state(records[r])}" for r in stopped if process_state(records[r])]
    lines.append("Every rank:")
    for r, row in enumerate(records):
        lines.append(f"  rank {r}: {describe(row, now, r in finished, r in stopped)}")
    return "\n".join(lines)

"""The progress board: where each rank says which collective it is in, and whom it waits for.

A hang has two sides: the rank that waits and the rank that does not come.
Only the first is visible from inside a collective, and a timeout that fires
there blames the messenger.  So every rank keeps one row on a board that
someone *outside* the collective reads -- the local launcher's parent process
(shared memory), or under torchrun each rank's watchdog thread (the rows are
published to the rendezvous store, see :mod:`minizero.run.torchrun`):

* which collective (its number, kind, size and the stage's tag) it is in, or
  that it is in none and since when;
* which part of it (fingerprint exchange, reduce-scatter step 2, ...);
* whether it is blocked waiting for a peer, and which one;
* when it last made progress (a message arrived or left);
* a **heartbeat**: the time, refreshed every :data:`HEARTBEAT_S` by a light
  thread of the rank's own (:class:`Heartbeat`), and the rank's process id.

The heartbeat is what tells a rank that waits from a rank that is *frozen*:
a process stopped by SIGSTOP (Ctrl-Z, a debugger) stops all its threads,
this one included, so its row goes on saying "waiting for a peer" while the
heartbeat stops: its row is stale, and the heartbeat says so.

A stall is a collective with no progress for ``timeout_s`` -- measured from
the last progress, never from the start of the run, so a long healthy run is
never stopped.  :mod:`minizero.comm.stall` reads the board and names the rank
that stopped.

The board is the launcher's, one per process, like torch.distributed's default
process group: :func:`install` puts it up, every :class:`~minizero.comm.Comm`
created afterwards writes to it.  Without a launcher the board is a no-op.
"""
from __future__ import annotations

import ctypes
import os
import socket
import threading
import time
from contextlib import contextmanager

from .fingerprint import KINDS

IDLE, IN_COLLECTIVE = 0.0, 1.0
NOBODY, ANYONE = -2.0, -1.0  # values of waiting_on besides a rank number
FIELDS = ("state", "seq", "kind", "numel", "part", "step", "waiting_on", "entered", "progress", "left",
          "tag_step", "tag_backward", "tag_syncing", "collectives", "heartbeat", "pid", "task")
TEXT = 120
PARTS = ("fingerprint exchange", "reduce-scatter", "all-gather", "broadcast", "gather to root",
         "broadcast from root", "torch collective", "push", "pull", "all-to-all", "part named by its caller",
         "")  # "": no part yet (the last)
#: The board holds numbers: each part's, looked up once per ring step; a part outside :data:`PARTS` (a lab's own ring
#: may say ``"rs"``) is reported as the caller-named one.
_PART_NUMBER = {part: float(i) for i, part in enumerate(PARTS)}
OTHER_PART = _PART_NUMBER["part named by its caller"]
_F = {name: i for i, name in enumerate(FIELDS)}
#: Seconds between two heartbeats.  A beat costs one write of a float; ten a second is nothing.
HEARTBEAT_S = 0.1


class ProgressBoard:
    """One rank's row: ``values`` (float64, one per field) and ``text`` (the collective's tag, bytes)."""

    def __init__(self, rank: int, values=None, text=None):
        self.rank = rank
        self.values = values if values is not None else (ctypes.c_double * len(FIELDS))()
        self.text = text if text is not None else ctypes.create_string_buffer(TEXT)
        # heartbeat 0: none yet -- a row nobody beats for (a rank not started) is never called frozen.
        self._set(state=IDLE, seq=-1.0, waiting_on=NOBODY, left=time.time(), part=float(len(PARTS) - 1),
                  heartbeat=0.0, pid=0.0, task=0.0)

    def task_started(self) -> None:
        """The rank took a task: a deadline on time spent outside collectives counts from here, not from the
        task's submission (a fresh rank may still have been joining its group then)."""
        self._set(task=time.time())

    def _set(self, **fields) -> None:
        for name, value in fields.items():
            self.values[_F[name]] = value

    # ---------------------------------------------------------------- writer: the Comm
    def enter(self, call) -> None:
        """``call`` (a :class:`~minizero.comm.fingerprint.Call`) begins."""
        now = time.time()
        self.text.value = call.tag.what.encode()[: TEXT - 1]
        # The time first, the state last: a watchdog reading between two writes (the row is not written at once)
        # must never see a collective entered at time 0 -- "no progress for 1795639490 s" was once read so.
        self._set(entered=now, progress=now, seq=float(call.seq), kind=float(KINDS.index(call.kind)),
                  numel=float(call.numel), part=float(len(PARTS) - 1), step=-1.0, waiting_on=NOBODY,
                  tag_step=float(call.tag.step), tag_backward=float(call.tag.backward),
                  tag_syncing=float(call.tag.syncing), state=IN_COLLECTIVE)

    def at(self, part: str, step: int = -1) -> None:
        """The collective moved on to ``part`` (step ``step``): that is progress.  Any label is taken."""
        self._set(part=_PART_NUMBER.get(part, OTHER_PART), step=float(step), progress=time.time())

    @contextmanager
    def waiting_for(self, peer: int | float):
        """Blocked until ``peer`` (a rank, or ANYONE) sends or receives; its end is progress."""
        self._set(waiting_on=float(peer))
        try:
            yield
        finally:
            self._set(waiting_on=NOBODY, progress=time.time())

    def leave(self) -> None:
        self._set(state=IDLE, waiting_on=NOBODY, left=time.time(), collectives=self.values[_F["collectives"]] + 1)

    def beat(self) -> None:
        """This process is alive and scheduled: what a frozen one cannot say."""
        self._set(heartbeat=time.time(), pid=float(os.getpid()))

    # ---------------------------------------------------------------- reader: the watchdog
    def record(self) -> dict:
        """A plain snapshot of the row (what a watchdog compares and publishes), with the host it runs on:
        a reader elsewhere cannot look its process id up."""
        return {**self.read(self.rank, self.values, self.text), "host": socket.gethostname()}

    @staticmethod
    def read(rank: int, values, text) -> dict:
        """The row of ``rank`` from its arrays -- without resetting them, as constructing a board would."""
        row = {name: values[i] for i, name in enumerate(FIELDS)}
        row["rank"] = rank
        row["what"] = text.value.decode(errors="replace")
        return row


class Heartbeat(threading.Thread):
    """The rank's own light thread: ``board.beat()`` every :data:`HEARTBEAT_S` seconds, for as long as the
    process runs.  A daemon -- it holds nothing, and a finished rank exits without waiting for it.  It needs
    the GIL for a moment per beat, so a rank stuck in native code that never releases the GIL stops beating
    too: frozen as far as Python is concerned, and named as such."""

    def __init__(self, board: ProgressBoard):
        super().__init__(name=f"minizero-heartbeat-rank{board.rank}", daemon=True)
        self.board = board

    def run(self) -> None:
        while True:
            self.board.beat()
            time.sleep(HEARTBEAT_S)


class NullBoard:
    """No launcher, no watchdog: nothing to write."""

    rank = -1

    def enter(self, call) -> None:
        pass

    def at(self, part: str, step: int = -1) -> None:
        pass

    @contextmanager
    def waiting_for(self, peer):
        yield

    def leave(self) -> None:
        pass


NULL_BOARD = NullBoard()
_board: ProgressBoard | NullBoard = NULL_BOARD


def install(board: ProgressBoard) -> None:
    """The launcher calls this once per rank process, before any Comm exists; the board's heartbeat starts."""
    global _board
    _board = board
    board.beat()  # before the thread's first turn: the row says at once whose process it is
    Heartbeat(board).start()


def installed() -> ProgressBoard | NullBoard:
    return _board

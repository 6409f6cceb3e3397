"""Under torchrun: join the process group from the environment, and watch for stalls.

``torchrun`` (or any launcher that sets ``RANK``, ``WORLD_SIZE``,
``MASTER_ADDR``) starts one process per rank; :func:`init_from_env` joins them
with the ``env://`` rendezvous.  With NCCL, ``LOCAL_RANK`` picks the GPU.

There is no parent of ours to watch the ranks, so each rank watches itself:
a daemon :class:`Watchdog` thread publishes this rank's row of the progress
board to the rendezvous store every ``interval`` seconds, and when this
rank's collective has made no progress for ``timeout_s`` it reads every
rank's row, prints who stopped (:mod:`minizero.comm.stall`) and ends the
process -- a thread cannot interrupt a receive that torch is blocked in.
torchrun then stops the other ranks.  A *frozen* rank (SIGSTOP: its
heartbeat stopped) would ignore torchrun's SIGTERM, and torchrun waits 30 s
before its SIGKILL: the watchdog that names a frozen rank on its own host
ends it first, so torchrun sees the frozen rank fail, and soon.  torch's own timeout is set later
(:func:`~minizero.run.rank.backstop_s`), so the watchdog, which sees every rank,
speaks first.

At the end, the rank takes down what it started, in order, while the
interpreter is still whole (:func:`shut_down`, an ``atexit`` hook): the
watchdog first, then the process group.  A daemon thread left to the
interpreter's finalization dies when it next takes the GIL -- and a thread
that takes it back on returning from a store call (C++, the GIL released)
dies by an unwinding that C++ turns into ``std::terminate``: "terminate
called without an active exception", exit -6, after all the work was done.
"""
from __future__ import annotations

import atexit
import json
import os
import signal
import sys
import threading
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from ..comm import progress
from ..comm.stall import is_stopped, stalled
from .rank import Rank, backstop_s

KEY = "minizero/progress/{}"


VARIABLES = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def under_torchrun() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ and "MASTER_ADDR" in os.environ


def check_environment(backend: str) -> None:
    """Refuse, before joining anything, an environment that is half torchrun's or contradicts itself --
    a hand-set ``RANK`` left in a shell, or a ``LOCAL_RANK`` with no GPU to go with it."""
    present = [v for v in VARIABLES if v in os.environ]
    if not present:
        return
    missing = [v for v in VARIABLES if v not in os.environ]
    if missing:
        raise ValueError(f"{', '.join(present)} set but {', '.join(missing)} not: launch with torchrun (which sets all "
                         f"of {', '.join(VARIABLES)}), or unset them and use --world-size to start ranks here")
    try:
        rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    except ValueError:
        raise ValueError(f"RANK={os.environ['RANK']!r}, WORLD_SIZE={os.environ['WORLD_SIZE']!r}, LOCAL_RANK="
                         f"{os.environ.get('LOCAL_RANK')!r}: torchrun sets whole numbers; launch with torchrun") from None
    if not 0 <= rank < world_size:
        raise ValueError(f"RANK={rank} with WORLD_SIZE={world_size}: a rank must be 0 to WORLD_SIZE-1; launch with "
                         f"torchrun, which numbers the ranks itself")
    if backend == "nccl" and local_rank >= torch.cuda.device_count():
        raise ValueError(f"rank {rank}: LOCAL_RANK={local_rank} but this node has {torch.cuda.device_count()} GPU(s); "
                         f"NCCL needs one GPU per rank: set torchrun's --nproc-per-node to at most "
                         f"{torch.cuda.device_count()}")


def init_from_env(backend: str | None = None, timeout_s: float = 300.0) -> Rank:
    """Join the process group torchrun describes; start this rank's watchdog.

    ``timeout_s``: how long a collective may go without progress before the
    run is ended as stalled (``compare --timeout``)."""
    if not timeout_s > 0:
        raise ValueError(f"timeout_s must be > 0 seconds, got {timeout_s!r}")
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
    if backend == "nccl":
        torch.cuda.set_device(local_rank)
    if not dist.is_initialized():
        board = progress.ProgressBoard(rank)
        progress.install(board)
        dist.init_process_group(backend, init_method="env://", timeout=timedelta(seconds=backstop_s(timeout_s)))
        watchdog = Watchdog(board, dist.distributed_c10d._get_default_store(), world_size, timeout_s)
        watchdog.start()
        atexit.register(shut_down, watchdog)
    return Rank(rank, world_size, local_rank, backend)


def shut_down(watchdog: "Watchdog", join_s: float = 10.0) -> None:
    """At exit: stop and join the watchdog (no store call may be in flight when the interpreter finalizes),
    then destroy the process group, joining torch's own threads, unless a collective is still in progress
    (the run is ending on a failure: destroying would wait for a collective that may never end)."""
    watchdog.stop(join_s)
    if watchdog.is_alive():  # a store call hung past join_s: destroying now would reopen the abort window
        return
    if dist.is_initialized() and watchdog.board.record()["state"] == progress.IDLE:
        dist.destroy_process_group()


class Watchdog(threading.Thread):
    """Publishes this rank's progress; ends the process when its collective has stalled."""

    def __init__(self, board: progress.ProgressBoard, store, world_size: int, timeout_s: float):
        super().__init__(name=f"minizero-watchdog-rank{board.rank}", daemon=True)
        self.board, self.store, self.world_size, self.timeout_s = board, store, world_size, timeout_s
        self.interval = min(1.0, timeout_s / 4)
        self.rows: list[dict | None] = []  # everyone's, as last read for a verdict
        self.culprits: list[int] = []  # the verdict's
        self._stopping = threading.Event()

    def run(self) -> None:
        while not self._stopping.is_set():
            if self.tick() is not None:
                self.end_frozen()
                os._exit(1)
            self._stopping.wait(self.interval)

    def stop(self, join_s: float = 10.0) -> None:
        """Finish the tick in progress (a store call is bounded by the store's timeout, but ``join_s`` bounds
        the wait here), then return: the thread has ended."""
        self._stopping.set()
        if self.is_alive():
            self.join(join_s)

    def end_frozen(self, wait_s: float = 1.0) -> list[int]:
        """SIGKILL the last verdict's culprits that the OS says are stopped on this host (their process ids are
        in their rows: a stopped process ignores torchrun's SIGTERM); wait ``wait_s`` so torchrun sees them fail
        before this rank.  Returns the process ids."""
        pids = [int(self.rows[r]["pid"]) for r in self.culprits if is_stopped(self.rows[r])]
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass  # gone already
        if pids:
            time.sleep(wait_s)
        return pids

    def tick(self) -> str | None:
        """Publish this rank's row; return the verdict if this rank's collective has stalled.
        A store that fails (its host gone) costs the others' rows, never the watchdog itself."""
        mine = self.board.record()
        try:
            self.store.set(KEY.format(self.board.rank), json.dumps(mine))
        except Exception:  # noqa: BLE001 -- judge on what is known
            pass
        now = time.time()
        if mine["state"] == progress.IDLE or now - mine["progress"] <= self.timeout_s:
            return None
        self.rows = self._everyone(mine)
        # A live rank's row here is up to one interval old: its heartbeat may look that much older.
        verdict = stalled(self.rows, now, self.timeout_s, lag_s=self.interval)
        if verdict is None:
            return None
        self.culprits = verdict[1]
        ending = [r for r in self.culprits if is_stopped(self.rows[r])]
        also = f"frozen {', '.join(f'rank {r}' for r in ending)} (it cannot end itself) and " if ending else ""
        print(f"[minizero watchdog, rank {self.board.rank}] {verdict[0]}\n"
              f"Ending {also}this rank; torchrun stops the others.", file=sys.stderr, flush=True)
        return verdict[0]

    def _everyone(self, mine: dict) -> list[dict | None]:
        rows: list[dict | None] = []
        for r in range(self.world_size):
            key = KEY.format(r)
            try:
                rows.append(mine if r == self.board.rank else
                            json.loads(self.store.get(key)) if self.store.check([key]) else None)
            except Exception:  # noqa: BLE001 -- an unreadable row is an unknown rank
                rows.append(None)
        return rows

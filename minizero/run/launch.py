"""Run a function on N ranks: locally (a pool of processes) or under torchrun.

The function receives a :class:`Rank` first, then its arguments, and may
return a (picklable) result; the caller gets the list of results in rank
order.  The same function runs unchanged under ``torchrun``: there
:func:`minizero.run.torchrun.init_from_env` builds the ``Rank`` from the environment.

Three promises, because a distributed run that hangs teaches nothing:

* an exception on any rank reaches the caller as :class:`RankError`, naming the
  rank and carrying its traceback, and the other ranks are stopped;
* a rank that dies (killed, segfault, ``os._exit``) ends the run at once;
* a **stall** -- a collective that made no progress for ``timeout_s`` -- ends
  the run with an error naming the rank that stopped and the collective the
  others wait in.  The clock starts at the collective's last progress, not at
  the start of the run: a long healthy run is never stopped.

:meth:`RankPool.run_within` adds a deadline for what no stall sees -- a rank
looping in its own code, in no collective, with no peer waiting for it -- and
says where each rank was when it stopped them (a stack sample, :mod:`minizero.run.stacks`):
how the labs' checker runs a learner's code.

The parent reads every rank's row of the progress board
(:mod:`minizero.comm.progress`) from shared memory, so it sees both sides of a
hang: who waits, and who does not come.  torch's own collective timeout is set
later than ``timeout_s`` (:func:`backstop_s`), so the parent speaks first; it
still bounds collectives the board cannot see (torch DDP's, FSDP2's).

Starting processes and a gloo group costs seconds, so :class:`RankPool`
keeps its ranks alive: the property suite runs hundreds of examples on one
pool per world size.  The start method is ``fork`` on Linux CPU, which -- unlike
``spawn`` -- can start a function defined in a notebook.
"""
from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import queue
import shutil
import sys
import tempfile
import time
import traceback
from datetime import timedelta
from typing import Any, Callable

import torch
import torch.distributed as dist

from ..comm import progress
from ..comm.stall import stalled
from .rank import Rank, backstop_s
from .stacks import StackSampler, last_stack, outside_collectives, sample, stacks_on_fatal_signal
from .torchrun import init_from_env, under_torchrun


class RankError(RuntimeError):
    """A rank raised, died or stalled.  ``rank`` is None when none could be blamed.  ``exitcode``: a dead
    rank's; ``stacks``: where each unfinished rank was when a run with a deadline was stopped
    (:meth:`RankPool.run_within`; a list of :class:`~minizero.run.stacks.Frame`, outermost first, or None when the
    rank did not answer); ``finished``: what the ranks that had finished returned -- a rank that failed alone and
    returned its error as a value, say, which its waiting peers then stalled on."""

    def __init__(self, message: str, rank: int | None = None, remote_traceback: str = "", *,
                 exitcode: int | None = None, stacks: dict | None = None, finished: dict | None = None):
        super().__init__(message)
        self.rank = rank
        self.remote_traceback = remote_traceback
        self.exitcode = exitcode
        self.stacks = stacks or {}
        self.finished = finished or {}  # rank -> what it returned, for the ranks that had finished when it stopped


def check_world_size(world_size: int) -> None:
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be an integer >= 1, got {world_size!r}")


# ------------------------------------------------------------------ local pool
def _rendezvous(rank: int, port, timeout_s: float) -> dist.TCPStore:
    """Rank 0 hosts the store on a free port (port 0: the OS picks, so there
    is no race between choosing a port and binding it) and publishes it in
    shared memory; the others wait for it and connect.  The parent hosts
    nothing: a server thread in a process that forks is a deadlock waiting
    to happen."""
    timeout = timedelta(seconds=timeout_s)
    if rank == 0:
        store = dist.TCPStore("127.0.0.1", 0, None, True, timeout=timeout, wait_for_workers=False)
        port.value = store.port
        return store
    deadline = time.monotonic() + timeout_s
    while port.value == 0:
        if time.monotonic() > deadline:
            raise RankError(f"rank {rank}: rank 0 never published its rendezvous port")
        time.sleep(0.005)
    return dist.TCPStore("127.0.0.1", port.value, None, False, timeout=timeout)


def _rank_main(rank, world_size, port, tasks, results, threads, timeout_s, row, text, backend="gloo", stacks=None,
               crash_log=None):
    """Body of each pool process: put up its board row, join the group, then run tasks until None."""
    torch.set_num_threads(threads)  # N ranks share the cores; oversubscribing them is slower
    crash_file = stacks_on_fatal_signal(crash_log) if crash_log else None  # noqa: F841 -- kept open for life
    if stacks is not None:
        stacks.serve()  # answers "where are you?" for this (the main) thread
    board = progress.ProgressBoard(rank, row, text)
    progress.install(board)
    if backend == "nccl":
        torch.cuda.set_device(rank)  # one GPU per rank on this machine
    store = _rendezvous(rank, port, backstop_s(timeout_s))
    dist.init_process_group(backend, store=store, rank=rank, world_size=world_size,
                            timeout=timedelta(seconds=backstop_s(timeout_s)))
    # Every rank connected before any runs a task: gloo's init can return on one rank while a peer is still
    # connecting to it, and a task that ends that rank at once (a crash, an exit) would then break the peer's
    # connection -- and the peer's death, not the cause, could be the one named.
    dist.barrier()
    me = Rank(rank, world_size, local_rank=rank, backend=backend)
    while True:
        task = tasks.get()
        if task is None:
            break
        board.task_started()
        try:
            fn, args, kwargs = pickle.loads(task)
            reply = (True, fn(me, *args, **kwargs))
        except BaseException:  # noqa: BLE001 -- every failure must reach the caller
            reply = (False, traceback.format_exc())
        try:
            payload = pickle.dumps(reply)  # by value: no shared-memory handles outlive the pool
        except Exception:  # noqa: BLE001
            payload = pickle.dumps((False, f"rank {rank}: result is not picklable:\n{traceback.format_exc()}"))
        results.put((rank, payload))
        # Nothing of a task outlives it: a result held here while the next task runs would keep its tensors --
        # on a GPU, allocated memory -- in the next one's measurements (found measuring CUDA peaks, issue 31).
        task = fn = args = kwargs = reply = payload = None
    dist.destroy_process_group()


def _import_before_forking() -> None:
    """Every rank builds an optimizer, and the first ``torch.optim.Optimizer.__init__`` in a process imports
    ``torch._dynamo`` (``torch/_compile.py``, ``_disable_dynamo``: a lazy import) -- sympy and all, seconds of CPU.
    Imported once here, it is inherited by every forked rank, including the ones a pool forks again after an error."""
    import torch._dynamo  # noqa: F401


class RankPool:
    """``world_size`` ranks on this machine, kept alive between :meth:`run` calls.

    ``timeout_s``: how long a collective may go without progress before the
    run is stopped as stalled.  ``backend="nccl"``: rank r on GPU r, started with
    ``spawn`` (CUDA cannot be used in a forked child)."""

    def __init__(self, world_size: int, *, timeout_s: float = 300.0, threads_per_rank: int = 1,
                 start_method: str | None = None, backend: str = "gloo"):
        check_world_size(world_size)
        if not timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0 seconds, got {timeout_s!r}")
        self.world_size = world_size
        self.timeout_s = timeout_s
        if start_method is None:
            start_method = "fork" if sys.platform.startswith("linux") and backend == "gloo" else "spawn"
        if start_method == "fork":
            _import_before_forking()
        context = mp.get_context(start_method)
        port = self._port = context.Value("i", 0)  # filled in by rank 0, see _rendezvous; kept: spawn unpickles it
        self._results = context.Queue()
        self._tasks = [context.Queue() for _ in range(world_size)]
        # The progress board: one row per rank in shared memory, written by the rank, read here.
        self._rows = [context.RawArray("d", len(progress.FIELDS)) for _ in range(world_size)]
        self._texts = [context.RawArray("c", progress.TEXT) for _ in range(world_size)]
        for r in range(world_size):
            progress.ProgressBoard(r, self._rows[r], self._texts[r])  # every row starts idle, now
        self._stacks = [StackSampler(context) for _ in range(world_size)]
        self._crash_dir = tempfile.mkdtemp(prefix="minizero-ranks-")  # where a rank killed by a signal leaves its stack
        self._processes = [
            context.Process(target=_rank_main, name=f"minizero-rank{r}", daemon=True,
                            args=(r, world_size, port, self._tasks[r], self._results, threads_per_rank, timeout_s,
                                  self._rows[r], self._texts[r], backend, self._stacks[r],
                                  os.path.join(self._crash_dir, f"rank{r}.txt")))
            for r in range(world_size)
        ]
        for process in self._processes:
            process.start()
        self.broken = False

    def run(self, fn: Callable[..., Any], *args, **kwargs) -> list[Any]:
        """Run ``fn(rank, *args, **kwargs)`` on every rank; results in rank order.

        On any failure the pool is shut down (its ranks may be stuck in a
        collective with the failed one) and :class:`RankError` is raised.
        """
        return self._run(None, fn, args, kwargs)

    def run_within(self, idle_s: float, fn: Callable[..., Any], *args, **kwargs) -> list[Any]:
        """:meth:`run`, where a rank may also not spend more than ``idle_s`` seconds of the task outside every
        collective -- looping in its own code, say, which no stall timeout sees when no peer waits for it.  When
        that ends the run, or a stall does, the :class:`RankError` carries a stack sample of each rank that had
        not finished (``stacks``): where the loop was."""
        if not idle_s > 0:
            raise ValueError(f"idle_s must be > 0 seconds, got {idle_s!r}")
        return self._run(idle_s, fn, args, kwargs)

    def _run(self, idle_s: float | None, fn, args, kwargs) -> list[Any]:
        if self.broken:
            raise RankError("this RankPool was shut down after an earlier failure; create a new one")
        task = pickle.dumps((fn, args, kwargs))
        started = time.time()
        for q in self._tasks:
            q.put(task)
        results: dict[int, Any] = {}
        while len(results) < self.world_size:
            try:
                rank, payload = self._results.get(timeout=0.05)
            except queue.Empty:
                self._watch(results, started, idle_s)
                continue
            ok, value = pickle.loads(payload)
            if not ok:
                time.sleep(0.2)  # if a peer died, that death -- not this symptom -- is the news
                self._check_deaths()
                self.close(kill=True)
                raise RankError(f"rank {rank} raised:\n{value}", rank=rank, remote_traceback=value)
            results[rank] = value
        return [results[r] for r in range(self.world_size)]

    def records(self) -> list[dict]:
        """Every rank's row of the progress board, as it is now."""
        return [progress.ProgressBoard.read(r, row, text)
                for r, (row, text) in enumerate(zip(self._rows, self._texts, strict=True))]

    def _watch(self, finished: dict[int, Any], started: float, idle_s: float | None) -> None:
        """Between results: a dead rank, a stalled collective, or (``idle_s``) a rank outside every collective
        for that long ends the run."""
        self._check_deaths()
        now, records = time.time(), self.records()
        verdict = stalled(records, now, self.timeout_s, finished=set(finished))
        if verdict is None and idle_s is not None:
            verdict = outside_collectives(records, now, started, idle_s, finished)
        if verdict is not None:
            message, culprits = verdict
            stacks = {}
            if idle_s is not None:  # asked before the kill: where each unfinished rank is
                stacks = sample({r: s for r, s in enumerate(self._stacks) if r not in finished})
            self.close(kill=True)
            raise RankError(message + "\nThe run was stopped.", rank=culprits[0] if len(culprits) == 1 else None,
                            stacks=stacks, finished=dict(finished))

    def _check_deaths(self) -> None:
        for rank, process in enumerate(self._processes):
            if process.exitcode is not None:
                stack = last_stack(os.path.join(self._crash_dir, f"rank{rank}.txt"))
                self.close(kill=True)
                said = f"\nIts Python stack when it died:\n{stack}" if stack else ""
                raise RankError(f"rank {rank} died with exit code {process.exitcode} "
                                f"(negative: killed by that signal); the other ranks were stopped{said}", rank=rank,
                                exitcode=process.exitcode)

    def close(self, kill: bool = False) -> None:
        if self.broken:
            return
        self.broken = True
        if not kill:
            for q in self._tasks:
                q.put(None)
            for process in self._processes:
                process.join(timeout=10)
        for process in self._processes:
            if process.is_alive():
                process.kill()
            process.join(timeout=10)
        shutil.rmtree(self._crash_dir, ignore_errors=True)

    def __enter__(self) -> "RankPool":
        return self

    def __exit__(self, *exc) -> None:
        self.close(kill=exc[0] is not None)


def run(fn: Callable[..., Any], world_size: int, *args, timeout_s: float = 300.0, **kwargs) -> list[Any]:
    """Start ``world_size`` ranks, run ``fn(rank, *args, **kwargs)`` on each, stop them.
    ``timeout_s``: how long a collective may go without progress (see :class:`RankPool`).

    Under torchrun this process *is* one rank: ``fn`` runs here and the list
    holds just this rank's result.
    """
    if under_torchrun():
        return [fn(init_from_env(timeout_s=timeout_s), *args, **kwargs)]
    with RankPool(world_size, timeout_s=timeout_s) as pool:
        return pool.run(fn, *args, **kwargs)

"""The communication thread: where asynchronous collectives run, one at a time, in order.

Every rank issues its collectives in the same order, and one thread per
:class:`~minizero.comm.base.Comm` runs them in that order -- so the messages
of two collectives never interleave, and a bucket's all-reduce can overlap
backward on the main thread.  What a function running there issues -- a collective, ``async_op`` or not, or
another submitted function -- runs inline, at once: queued, it would wait behind the function that waits for it.

The thread is a *daemon*: a rank whose main thread raised while a collective
is blocked waiting for a peer must be able to exit at once.  (A
``ThreadPoolExecutor`` worker is joined at interpreter exit, so such a rank
would linger until the process group's timeout.)
"""
from __future__ import annotations

import queue
import threading
import time
from concurrent.futures import Future
from typing import Callable

import torch

from .port import sleep_until


class Work:
    """Handle of an asynchronous collective; ``wait()`` re-raises its error.

    ``waits``: observers told ``(start, end)`` of every wait that blocked -- the exposed
    communication a timeline draws (:mod:`minizero.observe.timeline`)."""

    def __init__(self, future: Future, waits: list | None = None):
        self._future = future
        self._waits = waits

    def wait(self) -> None:
        self.result()

    def done(self) -> bool:
        """Has the collective finished (or failed)?  Never blocks."""
        return self._future.done()

    def result(self):
        """Wait, and return what the submitted function returned."""
        if not self._waits or self._future.done():
            return self._future.result()
        start = time.perf_counter()
        try:
            return self._future.result()
        finally:
            for observer in self._waits:
                observer(start, time.perf_counter())


class DueWork(Work):
    """An ``async_op`` collective on a dialled network.  Its function returns once this rank's messages are through
    on loopback, with the moment the wire has them in; ``wait()`` sleeps until then, and ``done()`` is False before.
    Meanwhile the thread goes on to the next collective, whose messages leave at that moment at the earliest (the
    port chains them): queued collectives run back to back on the wire, as on a CUDA stream, with no wake-up of the
    host between them.  Its function does nothing after the collective, so nothing computes ahead of the wire."""

    def __init__(self, work: Work):
        super().__init__(work._future, work._waits)

    def done(self) -> bool:
        if not self._future.done():
            return False
        return self._future.exception() is not None or time.perf_counter() >= self._future.result()

    def result(self) -> None:
        due = super().result()
        if time.perf_counter() < due:
            start = time.perf_counter()
            sleep_until(due)
            for observer in self._waits or ():
                observer(start, time.perf_counter())


class CommThread:
    """A single daemon worker running submitted functions in submission order."""

    runs_elsewhere = True  # a collective issued on another thread must queue here, behind what was submitted

    def __init__(self, name: str, waits: list | None = None):
        self._waits = waits
        # The CUDA device is per host thread: a new thread starts on GPU 0, whatever the rank's is.  The
        # thread runs on the device current where it was made (the rank's: torchrun set it from LOCAL_RANK).
        self._device = torch.cuda.current_device() if torch.cuda.is_available() and torch.cuda.is_initialized() \
            else None
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._serve, name=name, daemon=True)
        self._thread.start()

    @property
    def here(self) -> bool:
        """Is the caller this thread (a collective called by a submitted function runs inline)?"""
        return threading.get_ident() == self._thread.ident

    def submit(self, fn: Callable, *args) -> Work:
        future: Future = Future()
        if self.here:  # from a function this thread runs: queued, it would wait behind its caller -- forever, if the
            self._run([future, fn, args])  # caller waits for it -- so it runs now, as a blocking collective called here does
            return Work(future)  # (a wait for it is this thread's, not the host's: no exposed wait to observe)
        self._queue.put([future, fn, args])
        return Work(future, self._waits)

    def _serve(self) -> None:
        # Collectives run here on the thread's current stream, which is the device's default stream -- the
        # one the main thread computes on -- so NCCL orders each collective after the kernels that produced
        # its tensors, and the kernels after it wait for it, with no host synchronisation.  Backward's kernels
        # queued after it wait too: under NCCL a Comm uses a stream of its own instead (.stream).
        if self._device is not None:
            torch.cuda.set_device(self._device)
        while True:
            task = self._queue.get()
            if task is None:
                return
            self._run(task)

    @staticmethod
    def _run(task: list) -> None:
        """Run ``[future, fn, args]``, emptying the list: nothing the thread's loop holds keeps the function once it has
        run (a caller on this thread, :meth:`submit`'s inline path, still holds its own references)."""
        future, fn, args = task
        task.clear()
        if not future.set_running_or_notify_cancel():
            return
        try:
            outcome, failed = fn(*args), False
        except BaseException as error:  # noqa: BLE001 -- delivered to whoever waits
            outcome, failed = error, True
        # Let go of the task before anyone hears it is done, not when the next one arrives: its closure may
        # hold a bucket's packed full gradients (ZeRO-2), which must not outlive their reduce-scatter.
        del fn, args
        if failed:
            future.set_exception(outcome)
        else:
            future.set_result(outcome)

    def stop(self) -> None:
        """Stop once what was submitted is done; do not wait for it."""
        self._queue.put(None)

    def close(self) -> None:
        """Finish what was submitted, then stop."""
        self.stop()
        self._thread.join()


class AllOf:
    """Several collectives as one handle: done when every one is; ``result()`` waits for them all (in order, the
    first error raised once none is left running) and returns ``value`` -- what they wrote into."""

    def __init__(self, works: list, value=None):
        self._works, self._value = works, value

    def done(self) -> bool:
        return all(work.done() for work in self._works)

    def wait(self) -> None:
        wait_all(self._works)

    def result(self):
        self.wait()
        return self._value


def wait_all(works: list[Work]) -> None:
    """Wait for every one of ``works`` in order; after an error, for the rest too (nothing left running into the
    next step), then raise the first."""
    try:
        for work in works:
            work.wait()
    except BaseException:
        drain(works)
        raise


def drain(works: list[Work]) -> None:
    """Wait for every one of ``works``, ignoring their errors: after a failure, so that nothing is left
    running into the next step (the first error is already on its way up)."""
    for work in works:
        try:
            work.wait()
        except Exception:  # noqa: BLE001
            pass

"""Buckets launched as they become ready: a bucket's collective starts the moment its last gradient is final.

Gradients are produced by backward in roughly reverse registration order, so a stage packs them into buckets in
that order (ddp-bucketed: flat buffers its ``.grad`` s are views into; ZeRO-2 and -3: its flat groups); the first
bucket fills first and its collective can run while backward still computes the rest.  :class:`ReadyOrder` tracks
which parameters of which bucket are final and launches buckets in index order -- every rank the same order, or the
collectives would pair different buckets; :class:`BucketPipeline` runs each launched bucket's collective on the
communication thread and waits for them all after backward.  (torch DDP: ``bucket_cap_mb=25``.)
"""
from __future__ import annotations

import math
from contextlib import contextmanager
from typing import Callable

from torch import nn

from ..comm import Comm
from ..comm.thread import drain

MiB = 1 << 20
#: ZeRO-2's and -3's default ``reduce_scatter_buffers``: FSDP2 packs a bucket once the reduce-scatter before it finished
#: (``FSDPParamGroup.post_backward``; ``set_reduce_scatter_max_input_buffers`` raises it), so one is in flight at a time.
MAX_IN_FLIGHT = 1


def check_bucket_mb(bucket_mb: float) -> None:
    if not (isinstance(bucket_mb, (int, float)) and 0 < bucket_mb < math.inf):
        raise ValueError(f"bucket_mb must be a finite number > 0, got {bucket_mb!r} (torch DDP's default is 25)")


class ReadyOrder:
    """Which parameters of which bucket hold their final gradient; launches buckets in index order.

    Every rank must start bucket collectives in the same order -- the ring pairs
    rank r's bucket i with its neighbours' bucket i -- so a bucket that completes
    early waits for the ones before it.
    """

    def __init__(self, buckets: list[list[nn.Parameter]], launch):
        self._slot = {id(p): (b, i) for b, params in enumerate(buckets) for i, p in enumerate(params)}
        self._sizes = [len(params) for params in buckets]
        self._ready: list[set[int]] = [set() for _ in buckets]
        self._launch = launch  # launch(bucket_index)
        self._next = 0

    def mark(self, param: nn.Parameter) -> None:
        b, i = self._slot[id(param)]
        self._ready[b].add(i)
        while self._next < len(self._sizes) and len(self._ready[self._next]) == self._sizes[self._next]:
            self._launch(self._next)
            self._next += 1

    def missing(self) -> list[tuple[int, int]]:
        """(bucket, position) of every parameter not marked since the last reset."""
        return [(b, i) for b, size in enumerate(self._sizes) for i in range(size) if i not in self._ready[b]]

    def complete_all(self) -> None:
        """Launch whatever has not been launched, in order (unused parameters: their slots hold zeros)."""
        for b, i in self.missing():
            self._ready[b].add(i)
        while self._next < len(self._sizes):
            self._launch(self._next)
            self._next += 1

    def reset(self) -> None:
        for ready in self._ready:
            ready.clear()
        self._next = 0


class BucketPipeline:
    """Buckets' collectives overlapped with backward: used by ``ddp-bucketed``, ``zero2`` and ``zero3``.

    1. :meth:`mark` each parameter as its gradient becomes final (from a post-accumulate-grad hook);
    2. a bucket whose parameters are all marked -- and every bucket before it -- is *launched*:
       ``start(index)`` runs here, on the main thread (pack, free), and returns the collective, which runs
       on the communication thread while backward goes on;
    3. at the end of backward, :meth:`launch_rest` launches what never completed (unused parameters) and
       :meth:`wait_all` collects every bucket's result in index order.

    A round is one backward's worth: inside ``with pipeline.round():``, whatever happens -- an error in a
    hook, a check that refuses, a collective that fails -- nothing is left running and nothing marked.

    ``max_in_flight``: for stages whose ``start`` packs a bucket into a new buffer (ZeRO-2 and -3: their
    ``reduce_scatter_buffers``), the most buckets launched and not yet done.  Before starting another, the pipeline
    waits for the oldest (FSDP2's rule), so however slow the network, backward holds at most that many packed buckets
    and the one being packed, whose gradients it frees once copied (:mod:`minizero.course.harness.backward_memory`).
    ``None``: no bound (``ddp-bucketed``'s buckets are reduced in place; waiting would save nothing).
    """

    def __init__(self, comm: Comm, buckets: list[list[nn.Parameter]], start: Callable[[int], Callable[[], object]],
                 max_in_flight: int | None = None):
        if max_in_flight is not None and not (type(max_in_flight) is int and max_in_flight >= 1):
            raise ValueError(f"max_in_flight must be a whole number >= 1 (or None: no bound), got {max_in_flight!r}")
        self.comm, self._start = comm, start
        self._order = ReadyOrder(buckets, self._launch)
        self._works: dict[int, object] = {}
        self.max_in_flight = max_in_flight

    def in_flight(self) -> list[int]:
        """The buckets launched this round whose collective has not finished."""
        return [index for index, work in self._works.items() if not work.done()]

    def _launch(self, index: int) -> None:
        if self.max_in_flight is not None:
            # Its error surfaces in wait_all, not here: whether it is still running is timing, so raising here would
            # stop backward after another bucket on each rank, and the ranks would pair different collectives next.
            pending = self.in_flight()  # in launch order
            drain([self._works[oldest] for oldest in pending[:max(0, len(pending) - self.max_in_flight + 1)]])
        collective = self._start(index)
        if not callable(collective):  # else the communication thread's "'NoneType' object is not callable"
            raise TypeError(f"rank {self.comm.rank}: launching bucket {index} returned {collective!r}, not a function: "
                            f"{getattr(self._start, '__qualname__', 'the launch')} must return the collective for "
                            f"the communication thread to run (a function of no arguments), not run it")
        self._works[index] = self.comm.submit(collective)

    def mark(self, param: nn.Parameter) -> None:
        self._order.mark(param)

    def missing(self) -> list[tuple[int, int]]:
        """(bucket, position) of every parameter not marked this round."""
        return self._order.missing()

    def launch_rest(self) -> None:
        self._order.complete_all()

    def wait_all(self) -> list[tuple[int, object]]:
        """Every launched bucket's result, ``(index, result)`` in index order."""
        return [(index, self._works.pop(index).result()) for index in sorted(self._works)]

    def abandon(self) -> None:
        """After a backward that raised part-way: wait for what it launched, forget what it marked."""
        with self.round():
            pass

    @contextmanager
    def round(self):
        try:
            yield self
        finally:  # after an error too: nothing left running, nothing left marked
            drain(list(self._works.values()))
            self._works.clear()
            self._order.reset()

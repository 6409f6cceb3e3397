"""The GPU's communication "thread": a CUDA stream of its own, as torch DDP and FSDP2 overlap.

On a GPU the host only *queues* work; kernels run later, in order, on a stream.  A collective that joins the
compute stream's queue (what :class:`~minizero.comm.thread.CommThread` does under NCCL: its thread's current stream
is the device's default one) makes every backward kernel queued after it wait for it -- nothing overlaps.  So under
NCCL a :class:`~minizero.comm.base.Comm` submits to a :class:`CommStream` instead:

1. the communication stream first waits for what the compute stream has queued so far (the gradients a bucket
   packs were produced there): ``comm.wait_stream(compute)``, a device-side wait;
2. the submitted function runs *now*, on the host, with the communication stream current: its packing, its
   collective and its unpacking are queued there, beside backward's kernels.  (torch 2.13 queues a collective
   called with ``async_op=False`` on the current stream itself; earlier releases, the 2.11 of the GPU results
   among them, on NCCL's own stream between two device-side waits.  Either way the host blocks only under
   ``TORCH_NCCL_BLOCKING_WAIT``.);
3. an event marks the end; :meth:`StreamWork.wait` makes the stream that *uses* the result wait for that event.
   The host never waits for a collective -- only the kernels that read its result do.

**Memory in flight.**  The caching allocator frees a block for reuse on the stream that allocated it, at once: a
gradient made on the compute stream and dropped while the communication stream still reads it could be handed to
the next backward kernel.  torch has three answers -- ``record_stream`` (DDP's, with its costly delayed frees), the
process group's stash of tensors until ``wait()`` (ProcessGroupNCCL since 2.8, ``TORCH_NCCL_AVOID_RECORD_STREAMS``)
and FSDP2's *keep a reference until the consumer waited on the event*.  minizero does FSDP2's: a :class:`StreamWork`
holds the submitted function (and so every tensor its closure names) until :meth:`StreamWork.wait`, after which any
reuse on the compute stream is queued behind the collective.  The stash alone would not do: the collective runs
with ``async_op=False`` on the communication stream, so its ``wait()`` -- and the stash's release -- comes at once.
What the function allocates itself lives on the communication stream's pool, whose next user (the next submit)
first waits for the compute stream: a block the compute stream read and dropped is reused only after those reads.

``streams`` is the device API (``torch.cuda`` by default); the suite hands it a recorder, so the calls -- and
that no call blocks the host -- are checked on a machine without a GPU (``tests/test_comm_stream.py``).
"""
from __future__ import annotations

from typing import Callable


class StreamWork:
    """Handle of a function run on the communication stream; ``wait()`` is a device-side wait, and re-raises
    the function's error on the host (it was raised while queueing, so nothing of it is on the device)."""

    def __init__(self, streams, done, outcome, failed: bool, keep: tuple):
        self._streams, self._done = streams, done
        self._outcome, self._failed = outcome, failed
        self._keep = keep  # the function and its tensors: alive until the consumer's stream waited (see above)
        self._waited = False

    def wait(self) -> None:
        self.result()

    def done(self) -> bool:
        """Waited for already (the consumer's stream is queued behind it), or finished on the device.  Never blocks."""
        return self._waited or self._failed or self._done.query()

    def result(self):
        """Order the current stream after the function's kernels, then return what it returned."""
        if not self._waited:
            self._streams.current_stream().wait_event(self._done)
            self._waited, self._keep = True, ()
        if self._failed:
            raise self._outcome
        return self._outcome


class CommStream:
    """Runs submitted functions at once, on the host, with their kernels queued on one stream of their own."""

    runs_elsewhere = False  # nothing queues on the host: a collective issued outside a submit may run inline

    def __init__(self, streams=None):
        if streams is None:
            import torch
            streams = torch.cuda
        self._streams = streams
        self.stream = streams.Stream(streams.current_device())  # the rank's device (torchrun set it)
        self._depth = 0  # > 0 while a submitted function runs: collectives it calls run inline

    @property
    def here(self) -> bool:
        return self._depth > 0

    def submit(self, fn: Callable, *args) -> StreamWork:
        self.stream.wait_stream(self._streams.current_stream())
        self._depth += 1
        try:
            with self._streams.stream(self.stream):
                try:
                    outcome, failed = fn(*args), False
                except BaseException as error:  # noqa: BLE001 -- delivered to whoever waits, as the thread does
                    outcome, failed = error, True
                done = self._streams.Event()
                done.record(self.stream)
        finally:
            self._depth -= 1
        return StreamWork(self._streams, done, outcome, failed, keep=(fn, args))

    def stop(self) -> None:
        """Nothing runs on its own here; the stream is the device's and is freed with the Comm."""

    close = stop


class DeviceClock:
    """A dialled wire's wait on a GPU (:mod:`.port`): ``torch.cuda._sleep`` spins a kernel for a number of clock
    cycles on the current stream, so the wait sits where NCCL's kernels would, and the host goes on queueing.

    Cycles per second are measured once, on first use, from two spins timed by CUDA events (their difference
    removes the launch's fixed cost); ``seconds`` then converts at that rate."""

    def __init__(self, streams=None):
        if streams is None:
            import torch
            streams = torch.cuda
        self._streams = streams
        self.cycles_per_s: float | None = None

    def calibrate(self) -> float:
        timed = []
        for cycles in (1_000_000, 1_000_000, 11_000_000):  # the first warms the kernel up and is not used
            start, end = self._streams.Event(enable_timing=True), self._streams.Event(enable_timing=True)
            start.record()
            self._streams._sleep(cycles)
            end.record()
            end.synchronize()
            timed.append(start.elapsed_time(end) / 1e3)
        self.cycles_per_s = 10_000_000 / max(timed[2] - timed[1], 1e-9)
        return self.cycles_per_s

    def sleep(self, seconds: float) -> None:
        if seconds <= 0:
            return
        if self.cycles_per_s is None:
            self.calibrate()
        self._streams._sleep(int(seconds * self.cycles_per_s))

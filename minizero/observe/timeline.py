"""A timeline of each training step on one rank: what computed, what communicated, and the wait between.

Instrumentation from the outside, like the byte ledger: hooks on the stage
(forward, the first gradient of its output, every parameter's gradient, the
optimizer step) and a span observer on the :class:`~minizero.comm.base.Comm`.
No stage knows it is watched, and the one training loop (``train_step``) runs
unchanged.

What a step is made of (``time.perf_counter`` seconds):

* **compute**: forward; backward from its first gradient to the last
  parameter's; the optimizer step -- each less the times the main thread was
  blocked on communication (a ZeRO-3 unit waiting for its all-gather, ZeRO's
  all-gather after the step, a blocking all-reduce): those are **waits**;
* **communication**: every collective's span, on whichever thread ran it;
* **exposed**: communication during which nothing computed -- what a step
  pays for the network.  ``hidden = 1 - exposed / communication``.

The overlap tests read the *structure* (did a bucket's collective run while
backward still computed? was the last gradient ready long before the
transfers could have finished one after another?), which a dialled network
(:mod:`minizero.comm.network`) makes robust: each transfer lasts milliseconds
that cost no CPU.
"""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

from torch import nn


@dataclass
class StepTimeline:
    """One step on one rank: compute spans and collective spans, seconds from the step's start."""

    compute: list[tuple[str, float, float]] = field(default_factory=list)  # (what, start, end)
    comm: list[tuple[str, float, float]] = field(default_factory=list)  # (kind and tag, start, end)
    waits: list[tuple[float, float]] = field(default_factory=list)  # the main thread blocked on communication
    backward: tuple[float, float] | None = None  # (first gradient of the output, last parameter's gradient)
    end: float = 0.0  # the step's end

    def compute_s(self) -> float:
        return length(union([(s, e) for _, s, e in self.compute]))

    def comm_s(self) -> float:
        return length(union([(s, e) for _, s, e in self.comm]))

    def exposed_s(self) -> float:
        """Communication while nothing computed."""
        return length(minus(union([(s, e) for _, s, e in self.comm]), union([(s, e) for _, s, e in self.compute])))

    def hidden(self) -> float:
        comm = self.comm_s()
        return 1.0 - self.exposed_s() / comm if comm > 0 else 0.0

    def overlap_s(self, compute_what: str, comm_kind: str = "") -> float:
        """Seconds during which a compute span named ``compute_what`` and a collective of ``comm_kind`` ran."""
        a = union([(s, e) for w, s, e in self.compute if w.startswith(compute_what)])
        b = union([(s, e) for w, s, e in self.comm if w.startswith(comm_kind)])
        return length(a) - length(minus(a, b))


class Timeline:
    """Record each step of ``stage`` over ``comm``; ``units``: modules whose forwards are timed one by one
    (ZeRO-3's units, to see a prefetched all-gather run while the unit before it computes)."""

    def __init__(self, stage: nn.Module, model: nn.Module, comm, units: list[nn.Module] = ()):
        self.steps: list[StepTimeline] = []
        self._now: StepTimeline | None = None
        self._origin = 0.0
        comm.add_span_observer(self._collective)
        stage.register_forward_pre_hook(lambda m, a: self._begin("forward"))
        stage.register_forward_hook(self._forward_done)
        for i, unit in enumerate(units):
            unit.register_forward_pre_hook(lambda m, a, i=i: self._begin(f"forward unit {i}"))
            unit.register_forward_hook(lambda m, a, out, i=i: self._end(f"forward unit {i}"))
        for p in model.parameters():
            if p.requires_grad:
                p.register_post_accumulate_grad_hook(self._gradient)
        step = stage.step

        def timed_step():
            self._begin("optimizer step")
            try:
                step()
            finally:
                self._end("optimizer step")
                self._close()

        stage.step = timed_step
        self._open: dict[str, float] = {}

    def start(self) -> None:
        """A step begins (call before ``train_step``)."""
        self._origin = time.perf_counter()
        self._now = StepTimeline()

    def _t(self) -> float:
        return time.perf_counter() - self._origin

    def _begin(self, what: str) -> None:
        if self._now is not None:
            self._open[what] = self._t()

    def _end(self, what: str) -> None:
        if self._now is not None and what in self._open:
            self._now.compute.append((what, self._open.pop(what), self._t()))

    def _forward_done(self, module, args, output) -> None:
        self._end("forward")
        if self._now is not None and getattr(output, "requires_grad", False):
            output.register_hook(self._backward_starts)

    def _backward_starts(self, grad) -> None:
        if self._now.backward is not None:  # an earlier micro-batch's backward (accumulation)
            self._now.compute.append(("backward", *self._now.backward))
        t = self._t()
        self._now.backward = (t, t)

    def _gradient(self, param) -> None:
        if self._now is not None and self._now.backward is not None:
            self._now.backward = (self._now.backward[0], self._t())

    def _collective(self, call, start: float, end: float, thread: str) -> None:
        """A collective ran (``call``), or the main thread waited for one (``call`` None)."""
        now = self._now  # read once: the communication thread calls this while the main thread may close the step
        if now is None:
            return
        span = (start - self._origin, end - self._origin)
        if call is not None:
            now.comm.append((f"{call.kind} {call.tag.what}", *span))
        if call is None or thread == threading.main_thread().name:  # a collective on the main thread blocks it
            now.waits.append(span)

    def _close(self) -> None:
        """The step ends: backward's compute becomes a span, and every span loses the times the main
        thread waited for communication (those are the exposed wait, not compute)."""
        now = self._now
        if now.backward is not None:
            now.compute.append(("backward", *now.backward))
        waits = union(now.waits)
        now.compute = [(what, s, e) for what, a, b in now.compute for s, e in minus([(a, b)], waits)]
        now.end = self._t()
        self.steps.append(now)
        self._now = None


# ---------------------------------------------------------------- interval arithmetic
def union(spans: list[tuple[float, float]]) -> list[tuple[float, float]]:
    merged: list[list[float]] = []
    for s, e in sorted(spans):
        if merged and s <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], e)
        else:
            merged.append([s, e])
    return [(s, e) for s, e in merged]


def minus(a: list[tuple[float, float]], b: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """The parts of the (disjoint, sorted) spans ``a`` outside the (disjoint, sorted) spans ``b``."""
    out = []
    for s, e in a:
        for bs, be in b:
            if be <= s or bs >= e:
                continue
            if bs > s:
                out.append((s, bs))
            s = max(s, be)
            if s >= e:
                break
        if s < e:
            out.append((s, e))
    return out


def length(spans: list[tuple[float, float]]) -> float:
    return sum(e - s for s, e in spans)

"""ZeRO-2's backward, watched from outside: when each bucket's reduce-scatter leaves, and the gradient bytes a
rank holds meanwhile -- ZeRO-2's headline, drawn for lesson 8 beside ``ddp-bucketed``, whose buckets hold every
gradient all the time.

Nothing here is computed from a formula.  :func:`record_backward` trains an experiment on one rank with a
:class:`~minizero.observe.timeline.Timeline` (compute and collective spans) and three spies, none of which the stage
knows about:

* a post-accumulate-grad hook on every parameter, registered after the stage's own (so it runs after the
  stage marked the parameter, and after a bucket it completed was taken);
* each flat group's ``take_gradients`` wrapped: the moment a bucket's full gradients are packed into one flat
  copy and the parameters' ``.grad`` freed -- the launch of its reduce-scatter;
* a ``weakref.finalize`` on every packed copy: the moment its last reference goes, on whichever thread.

At each of these moments it samples the gradient bytes alive: every ``.grad`` storage the stage reports
(:meth:`held_tensors`, counted by :func:`minizero.observe.memory.held_bytes`, each storage once) plus the packed copies
not yet freed.  Between two samples nothing that is counted changes, so the step curve is exact, not a sample.
Communication scratch (the ring's chunks) and the reduce-scatter's shard-sized output before it reaches a
piece's ``.grad`` are not counted.
"""
from __future__ import annotations

import threading
import weakref
from dataclasses import dataclass, field

from ...observe.memory import held_bytes
from ...observe.timeline import StepTimeline, Timeline
from ...run.launch import Rank
from ...run.train import shard_step, train_step
from ..harness.equivalence import DTYPES
from ..harness.experiment import Experiment, build
from ..harness.tasks import TASKS


@dataclass
class BackwardRecord:
    """One training step on one rank: its spans, its bucket launches and its gradient memory."""

    stage: str
    world_size: int
    psi: int
    step: StepTimeline
    launches: list[tuple[int, float]] = field(default_factory=list)  # (bucket, seconds): gradients taken, sent off
    memory: list[tuple[float, int, int, str]] = field(default_factory=list)  # (seconds, .grad bytes, packed, why)
    freed_at_take: list[bool] = field(default_factory=list)  # per launch: no parameter of the bucket kept a .grad
    backward_done: float = 0.0  # when post_backward returned: every averaged shard is in a piece's .grad
    shard_bytes: int = 0  # the rank's shards of every bucket, padding included (0: the stage has no shards)
    packed_bytes: list[int] = field(default_factory=list)  # per launch: the bytes of the bucket's packed copy

    def total(self) -> list[tuple[float, int]]:
        return [(t, g + p) for t, g, p, _ in self.memory]

    def grad_bytes_after_backward(self) -> int:
        """The ``.grad`` bytes sampled when post_backward returned."""
        return next(g for _, g, _, why in self.memory if why == "backward done")


def record_backward(me: Rank, exp: Experiment) -> BackwardRecord:
    """Train ``exp`` on this rank; return its last step, watched (see the module's docstring)."""
    stage, model, comm, psi = build(me, exp)
    timeline = Timeline(stage, model, comm)
    lock, alive = threading.Lock(), {"grads": 0, "packed": 0}
    record = BackwardRecord(exp.stage, me.world_size, psi, StepTimeline())

    def sample(why: str, recount: bool = True) -> None:  # called with the lock held
        if timeline._now is None:
            return
        if recount:  # only the main thread changes .grad: the communication thread's samples reuse its count
            alive["grads"] = held_bytes({"grads": stage.held_tensors()["grads"]})["grads"]
        record.memory.append((timeline._t(), alive["grads"], alive["packed"], why))

    def freed(nbytes: int) -> None:
        with lock:
            alive["packed"] -= nbytes
            sample("packed copy freed", recount=False)

    groups = getattr(stage, "groups", []) if hasattr(stage, "pipeline") else []  # ZeRO-2's buckets are flat groups
    record.shard_bytes = sum(g.shard.numel() * g.shard.element_size() for g in groups)
    for index, group in enumerate(groups):
        def spied_take(take=group.take_gradients, group=group, index=index):
            full = take()
            with lock:
                nbytes = full.untyped_storage().nbytes()
                alive["packed"] += nbytes
                weakref.finalize(full, freed, nbytes)
                if timeline._now is not None:
                    record.launches.append((index, timeline._t()))
                    record.packed_bytes.append(nbytes)
                    record.freed_at_take.append(all(s.param.grad is None for s in group.segments))
                sample(f"bucket {index} taken")
            return full
        group.take_gradients = spied_take

    def gradient_ready(param) -> None:
        with lock:
            sample("gradient ready")

    for p in model.parameters():
        if p.requires_grad:
            p.register_post_accumulate_grad_hook(gradient_ready)
    post_backward = stage.post_backward

    def spied_post_backward():
        out = post_backward()
        with lock:
            sample("backward done")
            record.backward_done = timeline._t()
        return out

    stage.post_backward = spied_post_backward
    zero_grad = stage.zero_grad

    def spied_zero_grad(*args, **kwargs):  # the loop's first act: last step's gradients go here
        out = zero_grad(*args, **kwargs)
        with lock:
            sample("zero_grad")
        return out

    stage.zero_grad = spied_zero_grad
    task, dtype, n = TASKS[exp.task], DTYPES[exp.dtype], me.world_size
    try:
        for s in range(exp.steps):
            x, y = task.make_batch(exp.global_batch(n), exp.seed, s, dtype, **exp.model)
            with lock:
                record.launches, record.memory, record.freed_at_take, record.packed_bytes = [], [], [], []
                timeline.start()
                sample("step starts")
            train_step(stage, shard_step(x, y, me.rank, n, exp.accum))
    finally:
        comm.close()
    record.step = timeline.steps[-1]
    return record


#: The compute spans a :class:`~minizero.observe.timeline.Timeline` records, each in its colour.
COMPUTE = (("forward", "#a1c9f4"), ("backward", "#4c72b0"), ("optimizer step", "#8172b3"))


def plot_backward(ax_time, ax_memory, zero2: BackwardRecord, ddp: BackwardRecord) -> None:
    """Above: ZeRO-2's compute and collectives, each bucket's launch a tick.  Below: its gradient bytes over
    the same step (``.grad`` and packed copies, stacked), beside ``ddp-bucketed``'s at every sample of its step."""
    ms, psi, n = 1e3, zero2.psi, zero2.world_size
    step = zero2.step
    for what, color in COMPUTE:
        ax_time.broken_barh([(s * ms, (e - s) * ms) for w, s, e in step.compute if w == what], (1.65, 0.7),
                            color=color, label=what)
    for what, s, e in step.comm:
        color = "#dd8452" if what.startswith("reduce_scatter") else "#8c8c8c"
        ax_time.broken_barh([(s * ms, (e - s) * ms)], (0.65, 0.7), color=color, edgecolor="white", linewidth=0.5)
    for index, t in zero2.launches:
        ax_time.plot([t * ms] * 2, [0.3, 2.35], color="k", lw=0.6, alpha=0.6)
        ax_time.annotate(str(index), (t * ms, 0.3), fontsize=6, ha="center", va="top")
    ax_time.set_yticks([1, 2], ["reduce-scatter\n(grey: all-gather)", "compute"], fontsize=8)
    ax_time.set_ylim(-0.3, 2.5)
    ax_time.legend(fontsize=7, loc="lower left", ncol=3)
    ax_time.set_title(f"zero2, rank 0 of {n}: a bucket's gradients are taken (tick, bucket number) "
                      "and its reduce-scatter queued", fontsize=9)
    times = [t * ms for t, *_ in zero2.memory] + [step.end * ms]
    grads = [g / psi for _, g, _, _ in zero2.memory]
    packed = [p / psi for _, _, p, _ in zero2.memory]
    ax_memory.stairs(grads, times, fill=True, color="#4c72b0", alpha=0.8, label="zero2: .grad")
    ax_memory.stairs([g + p for g, p in zip(grads, packed, strict=True)], times, baseline=grads, fill=True, color="#dd8452",
                     alpha=0.8, label="zero2: packed copies not yet freed")
    ddp_held = sorted({total for _, total in ddp.total()})
    ax_memory.axhline(max(ddp_held) / ddp.psi, color="k", lw=1.5,
                      label=f"ddp-bucketed (its own step): {', '.join(f'{b / ddp.psi:.2f}' for b in ddp_held)} "
                            "at every sample")
    ax_memory.axhline(4 / n, color="k", ls="--", lw=1, label=f"4Ψ/N = {4 / n:.2f}: the shards")
    ax_memory.set_ylabel("gradient bytes / Ψ")
    ax_memory.set_xlabel("ms since the step began")
    ax_memory.set_ylim(0, 4.6)
    ax_memory.legend(fontsize=7, loc="upper left")
    ax_memory.grid(alpha=0.3)


def summary(zero2: BackwardRecord, ddp: BackwardRecord) -> dict[str, float]:
    """The figures the lesson prints, in bytes per parameter: deterministic ones and this run's."""
    psi = zero2.psi
    during = ("gradient ready", "packed copy freed")  # from the first gradient until post_backward returns
    backward = [(t, g, p) for t, g, p, why in zero2.memory
                if zero2.step.backward[0] <= t < zero2.backward_done and (why in during or why.endswith("taken"))]
    return {"ddp_min": min(b for _, b in ddp.total()) / ddp.psi, "ddp_max": max(b for _, b in ddp.total()) / ddp.psi,
            "zero2_after_backward": zero2.grad_bytes_after_backward() / psi,
            "zero2_grad_peak": max(g for _, g, _ in backward) / psi,
            "zero2_peak": max(g + p for _, g, p in backward) / psi,
            "buckets": len(zero2.launches), "largest_bucket": max(zero2.packed_bytes) / psi,
            "all_freed_at_take": all(zero2.freed_at_take)}

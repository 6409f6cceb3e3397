"""Fault injection: an inf in one rank's gradient at a chosen step (the loss scaler's overflow), and a bucket whose
collective fails on every rank (a backward that raised, caught, and the step run again)."""
from __future__ import annotations

import contextlib
import math

import torch


@contextlib.contextmanager
def poison_gradient(model, exp, step: int, rank: int, world_size: int | None):
    """At ``exp.overflow_at = (step, rank)``, put an inf into element 0 of the first trainable parameter's
    gradient on that rank (every micro-batch of the step) -- before any reduction, so under ZeRO only the
    rank owning that element sees it.  ``world_size`` None: the single-device reference, whose one
    gradient stands for every rank's."""
    target = exp.overflow_at and exp.overflow_at[0] == step and (world_size is None or exp.overflow_at[1] == rank)
    param = next((p for p in model.parameters() if p.requires_grad), None)
    handle = param.register_hook(_with_inf) if target and param is not None else None
    try:
        yield
    finally:
        if handle is not None:
            handle.remove()


def _with_inf(grad: torch.Tensor) -> torch.Tensor:
    grad = grad.clone()
    grad.view(-1)[0] = math.inf
    return grad


class LaunchFailed(RuntimeError):
    """The injected failure of :func:`failing_launch`: raised in place of a bucket's collective."""


@contextlib.contextmanager
def failing_launch(stage, exp, step: int):
    """At ``exp.launch_fails_at == step``: the first bucket launched in this step raises :class:`LaunchFailed` on the
    communication thread instead of running its collective -- on every rank, before any message leaves (an
    allocation that ran out of memory, say), so the ranks stay in step and the error reaches the end of backward,
    where the stage waits for its buckets.  The loop catches it and runs the step again: a stage whose pipeline was
    left with that round's marks and launches then trains wrong.  A stage without a bucket pipeline: nothing."""
    pipeline = getattr(stage, "pipeline", None)
    if exp.launch_fails_at != step or pipeline is None:
        yield
        return
    start, armed = pipeline._start, [True]

    def first_fails(index: int):
        collective = start(index)  # the stage's own launch: it packs (and, under ZeRO-2, frees) as ever
        if not armed[0] or not callable(collective):
            return collective
        armed[0] = False

        def fails():
            raise LaunchFailed(f"injected: bucket {index}'s collective failed before it began, on every rank, in "
                               f"step {step} (the checker's case: a caught error, then the step run again)")
        return fails

    pipeline._start = first_fails
    try:
        yield
    finally:
        pipeline._start = start

"""Fault injection for the loss scaler: an inf in one rank's gradient at a chosen step."""
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

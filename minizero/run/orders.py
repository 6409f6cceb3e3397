"""Backwards that do not each follow their own forward: the orders a user's loop may run besides torch's idiom.

The one training loop (:func:`~minizero.run.train.train_step`) runs each micro-batch's forward and then its
backward, the last one synchronising.  Real loops also run

* ``forwards then backwards``: every micro-batch's forward (each outside ``no_sync()``), then each backward,
  oldest first -- K synchronising backwards with no forward between them;
* ``retained``: torch's idiom (micro-batches 1..K-1 forward and backward inside ``no_sync()``), each backward run
  twice on a retained graph (``retain_graph=True``) -- its gradient counted twice, as on one device;
* ``inside, then outside``: the forwards of micro-batches 1..K-1 inside ``no_sync()``, the last outside, then
  every backward -- whether a backward synchronises is decided at *its own* forward, as on one device where the
  sum is what counts (minizero's stages decide so; torch's DDP decides at the latest forward: finding 3), so the
  first K-1 accumulate and the last synchronises the sum;
* ``both in one backward``: the same forwards, one backward of the sum of their losses.

Single-device training is the same in each (``.grad`` adds whatever the order; ``retained`` doubles it), so the
reference is the same loop over the global batch in one micro-batch.  torch's DDP gets three of the four wrong
(pytorch#47260; ``docs/verify.md``, finding 3): ``verify --every-order`` draws them for any wrapper,
``tests/test_sync_patterns.py`` holds them on every minizero stage.
"""
from __future__ import annotations

import contextlib
from typing import Callable

import torch

from .train import Step, sum_loss

ORDERS = ("forwards then backwards", "retained", "inside, then outside", "both in one backward")


def train_step_in_order(stage, step: Step, order: str, clip: tuple[float, float] | None = None,
                        optimizer: torch.optim.Optimizer | None = None, zero_grad: Callable[[], None] | None = None,
                        loss_fn: Callable = sum_loss) -> float:
    """One optimizer step whose backwards run in ``order`` (one of :data:`ORDERS`); returns this rank's summed loss.
    Zeroing, clipping and stepping are :func:`~minizero.run.train.train_step`'s."""
    if order not in ORDERS:
        raise ValueError(f"order={order!r}: one of {', '.join(map(repr, ORDERS))}")
    (zero_grad or (optimizer or stage).zero_grad)()
    scale = stage.world_size / step.global_count
    last = len(step.micro_batches) - 1
    losses = []
    for k, (x, y) in enumerate(step.micro_batches):
        inside = k < last and order in ("inside, then outside", "both in one backward", "retained")
        with stage.no_sync() if inside else contextlib.nullcontext():
            loss = loss_fn(stage(x), y)
            if order == "retained":  # each micro-batch's backward right after its forward, run twice
                stage.scale_loss(loss * scale).backward(retain_graph=True)
                stage.scale_loss(loss * scale).backward()
        losses.append(loss)
    if order != "retained":
        for loss in [sum(losses)] if order == "both in one backward" else losses:
            stage.scale_loss(loss * scale).backward()  # outside any no_sync(): each forward decided
    if clip is not None:
        stage.clip_grad_norm_(*clip)
    (optimizer or stage).step()
    return sum(loss.item() for loss in losses)

"""The one training loop.  It drives the reference and every stage alike.

The *global batch* of a step is the concatenation, in rank order, of every
rank's micro-batches over all ``K`` accumulation steps.  Each rank sums its
loss and scales it by ``world_size / global_count``; the stage then averages
gradients over ranks.  Result: the gradient of the mean loss over the global
batch -- exactly what the reference computes on the whole batch at once,
even when ranks hold different numbers of samples (a plain per-rank mean
would silently over-weight the small ranks).
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Callable, Sequence

import torch
import torch.nn.functional as F


@dataclass
class Step:
    """One optimizer step's data on one rank: ``K`` micro-batches (x, y)."""

    micro_batches: list[tuple[torch.Tensor, torch.Tensor]]
    global_count: int  # loss terms in the *global* batch (all ranks, all micro-batches)


def shard_step(x: torch.Tensor, y: torch.Tensor, rank: int, world_size: int, accum_steps: int = 1,
               rank_sizes: list[int] | None = None) -> Step:
    """This rank's share of a global batch: contiguous samples, cut into ``accum_steps`` micro-batches.

    ``rank_sizes`` (samples per rank) may be unequal; by default the batch
    splits evenly and must divide by ``world_size``.
    """
    if rank_sizes is None:
        if x.shape[0] % world_size:
            raise ValueError(f"global batch of {x.shape[0]} samples does not split evenly over {world_size} "
                             f"ranks; pass rank_sizes=[...] to split it unevenly (weighted correctly)")
        rank_sizes = [x.shape[0] // world_size] * world_size
    if len(rank_sizes) != world_size or sum(rank_sizes) != x.shape[0] or min(rank_sizes) < 0:
        raise ValueError(f"rank_sizes {rank_sizes} must be {world_size} non-negative counts summing to "
                         f"the global batch of {x.shape[0]} samples")
    start = sum(rank_sizes[:rank])
    mine = slice(start, start + rank_sizes[rank])
    micro = list(zip(x[mine].tensor_split(accum_steps), y[mine].tensor_split(accum_steps), strict=True))
    return Step(micro, global_count=y.numel())


def sum_loss(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Loss *summed* over the batch: cross-entropy for integer targets, squared error otherwise.

    The training loop divides by the global number of loss terms, so the
    gradient is that of the mean over the *global* batch whatever the per-rank
    split -- even when ranks hold different numbers of samples.
    """
    if target.dtype in (torch.int64, torch.int32):
        return F.cross_entropy(output.reshape(-1, output.shape[-1]), target.reshape(-1), reduction="sum")
    return F.mse_loss(output, target, reduction="sum")


def train_step(stage, step: Step, loss_fn: Callable = sum_loss, clip: tuple[float, float] | None = None,
               syncs: Sequence[bool] | None = None, optimizer: torch.optim.Optimizer | None = None,
               zero_grad: Callable[[], None] | None = None) -> float:
    """One optimizer step; returns this rank's *summed* loss (add over ranks, divide by global_count).

    ``clip=(max_norm, norm_type)`` clips the averaged gradient by its global
    norm before the step, as ``torch.nn.utils.clip_grad_norm_`` would on one device.
    ``syncs``: whether each micro-batch's backward synchronises (outside ``no_sync()``); None: the last only,
    torch's idiom -- one reduction per step.  Every one synchronising (lesson 8: under ZeRO-2 a rank then never
    holds full gradients between micro-batches) adds each average to the averaged gradient: the same update, K
    reductions; so does any order that ends synchronising -- a gradient synchronised twice adds, as ``.grad`` does.
    ``optimizer``: one built *after* wrapping, over ``stage.parameters()`` (FSDP2's order), which the loop
    zeroes and steps itself; without it the stage's own ``zero_grad()`` and ``step()`` run the optimizer it
    was given.  ``zero_grad``: what the user's loop calls instead to zero the gradients -- ``model.zero_grad()``,
    say, which wrapping routes to the stage's.
    """
    if syncs is not None and (len(syncs) != len(step.micro_batches) or not syncs[-1]):
        raise ValueError(f"syncs={tuple(syncs)}: one per micro-batch ({len(step.micro_batches)}), the last True -- "
                         f"a step after a backward inside no_sync() would step on gradients never averaged")
    (zero_grad or (optimizer or stage).zero_grad)()
    scale = stage.world_size / step.global_count
    total = 0.0
    last = len(step.micro_batches) - 1
    for k, (x, y) in enumerate(step.micro_batches):
        # Only the last micro-batch's backward synchronises (torch's no_sync idiom), unless asked otherwise.
        syncing = k == last if syncs is None else syncs[k]
        with contextlib.nullcontext() if syncing else stage.no_sync():
            loss = loss_fn(stage(x), y)
            stage.scale_loss(loss * scale).backward()  # times the loss scale, under fp16 mixed precision
        total += loss.item()
    if clip is not None:
        stage.clip_grad_norm_(*clip)
    (optimizer or stage).step()
    return total


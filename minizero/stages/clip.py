"""Clipping the global gradient norm, as ``torch.nn.utils.clip_grad_norm_`` does on one device.

The norm is of the *averaged* gradient of every parameter.  A stage that holds every gradient (the reference, DDP)
clips what it holds.  A sharded stage holds disjoint pieces of it: each rank sums its pieces' ``|g|^p``, the sum is
all-reduced over the ranks that shard (MAX for the inf-norm), and every rank scales its pieces by the same
coefficient -- DeepSpeed's way.  A norm taken of one rank's pieces alone, or of gradients not yet averaged, is the
known bug this file exists to avoid.  Methods of the stages (``self`` is the stage).
"""
from __future__ import annotations

import functools
import math

import torch

from ..comm import Comm, ReduceOp, Tag


def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
    """``torch.nn.utils.clip_grad_norm_`` over the gradients this rank holds -- all of them,
    already averaged, for the reference and DDP.  Sharded stages override it."""
    # Zero-size gradients add nothing to any norm, and torch refuses their inf-norm.  Under mixed
    # precision the clipped gradients are the masters' (unscaled, fp32), as after GradScaler.unscale_.
    params = self.master.unscaled_masters() if self.master else [p for _, p in self.trainable()]
    return torch.nn.utils.clip_grad_norm_([p for p in params if p.grad is not None and p.grad.numel() > 0],
                                          max_norm, norm_type)


def clip_pieces_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
    """Global-norm clipping over the pieces: each rank holds disjoint pieces of the averaged gradient."""
    # Mixed precision: the masters' unscaled fp32 gradients, as after GradScaler.unscale_.
    clipped = self.master.unscaled_masters() if self.master else [piece.param for piece in self.pieces()]
    replicated = [group.replicated for group in self.groups for _ in group.pieces]
    counted = [p.grad for p, r in zip(clipped, replicated, strict=True) if p.grad is not None and not r]
    replicas = [p.grad for p, r in zip(clipped, replicated, strict=True) if p.grad is not None and r]
    # The norm's dtype and device: the same on every rank, including one that owns no piece.
    dtype = functools.reduce(torch.promote_types, [g.optimizer_dtype for g in self.groups], torch.float32)
    device = self.groups[0].shard.device if self.groups else torch.device("cpu")
    # Summed over the ranks that shard (each holds disjoint pieces; a replica of a shard holds the same ones).
    first = self.shard_comm.rank == 0
    return clip_sharded_grad_norm_(counted + (replicas if first else []), max_norm, norm_type, self.shard_comm,
                                   dtype, device, self.tag("clip norm"), [] if first else replicas)


def clip_sharded_grad_norm_(grads: list[torch.Tensor], max_norm: float, norm_type: float, comm: Comm,
                            dtype: torch.dtype, device: torch.device, tag: Tag | None = None,
                            replicas: list[torch.Tensor] = ()) -> torch.Tensor:
    """Global-norm clipping when each rank holds disjoint pieces of the averaged gradient: one more
    collective (:func:`sharded_grad_norm`), then every rank scales its pieces by min(1, max_norm / norm) --
    ``torch.nn.utils.clip_grad_norm_``'s result without anyone holding all of it.  ``replicas``: gradients
    every rank holds alike (ZeRO-3's replicated modules), scaled too but counted once -- by the caller,
    who puts rank 0's in ``grads``."""
    grads = [g for g in grads if g.numel()]
    total = sharded_grad_norm(grads, norm_type, comm, dtype, device, tag)
    coefficient = torch.clamp(max_norm / (total + 1e-6), max=1.0)  # below max_norm nothing grows
    for g in grads + [g for g in replicas if g.numel()]:
        g.mul_(coefficient.to(g.device))  # (offloaded gradients are on the host, the norm on the device)
    return total[0]


def sharded_grad_norm(grads: list[torch.Tensor], norm_type: float, comm: Comm, dtype: torch.dtype,
                      device: torch.device, tag: Tag | None = None) -> torch.Tensor:
    """The global norm (shape ``[1]``) of gradients split disjointly over the ranks: SUM of |g|^p, or MAX for
    the inf-norm.  ``dtype``, ``device``: the norm's, the same on every rank."""
    grads = [g for g in grads if g.numel()]
    zero = torch.zeros(1, dtype=dtype, device=device)
    if math.isinf(norm_type):
        total = torch.stack([g.abs().max().to(device, dtype) for g in grads]).max().reshape(1) if grads else zero
        comm.all_reduce(total, ReduceOp.MAX, tag=tag)
        return total
    total = sum((g.abs().pow(norm_type).sum().to(device, dtype) for g in grads), zero).reshape(1)
    comm.all_reduce(total, ReduceOp.SUM, tag=tag)
    return total.pow(1.0 / norm_type)

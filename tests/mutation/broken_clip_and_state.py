"""Broken copies for issue 24's proofs (registered in ``register.py``): clipping whose coefficient
max_norm / (norm + eps) is not capped at 1 -- right wherever it clips, wrong wherever it should not --, a
wrap that drops the optimizer's state, and a checkpoint that keeps no rank's own random generator."""
from __future__ import annotations

import math

import torch

from minizero.stages.clip import sharded_grad_norm


def sharded_clip_uncapped(grads, max_norm, norm_type, comm, dtype, device, tag=None, replicas=()):
    """``clip_sharded_grad_norm_`` scaling by max_norm / (norm + eps) always: a gradient below max_norm grows."""
    grads = [g for g in grads if g.numel()]
    total = sharded_grad_norm(grads, norm_type, comm, dtype, device, tag)
    for g in grads + [g for g in replicas if g.numel()]:
        g.mul_(max_norm / (total + 1e-6))
    return total[0]


def clip_by_hand_uncapped(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
    """``Stage.clip_grad_norm_`` written by hand, the cap at 1 forgotten (the reference runs it too, so only a
    comparison with torch's own clipping catches it)."""
    params = self.master.unscaled_masters() if self.master else [p for _, p in self.trainable()]
    grads = [p.grad for p in params if p.grad is not None and p.grad.numel() > 0]
    norms = torch.stack([torch.linalg.vector_norm(g, norm_type) for g in grads])
    total = norms.max() if math.isinf(norm_type) else torch.linalg.vector_norm(norms, norm_type)
    for g in grads:
        g.mul_(max_norm / (total + 1e-6))
    return total


def drops_the_state(user, rebuilt, stepped_of) -> None:
    """What the stages did before: the optimizer rebuilt over pieces or masters starts empty."""


def no_rank_rng():
    """A checkpoint that stores a fresh generator's state instead of the rank's: dropout after a resume
    draws other masks than the uninterrupted run."""
    return {"cpu": torch.Generator().get_state()}

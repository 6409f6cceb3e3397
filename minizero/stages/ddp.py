"""Stage ``ddp``: the simplest correct data parallelism.

Every rank holds the whole model and a different slice of the global batch.
If all replicas start equal and apply the same update, they stay equal, and
the update equals single-device training on the global batch when it uses
the *average* of the ranks' gradients (the gradient of a mean is the mean of
the gradients).  So:

1. at wrap time, broadcast rank 0's parameters (ranks may have initialised
   differently);
2. when backward finishes, all-reduce (average) every gradient;
3. step the ordinary optimizer, identically on every rank.

The all-reduce runs once per backward, over one flat buffer per dtype, so
its cost is the ring all-reduce of the gradients: 2(N-1)/N * Psi * b bytes per
rank.  Inside ``no_sync()`` nothing is sent and gradients accumulate locally;
the first backward after it averages the accumulated sums (torch's idiom).
"""
from __future__ import annotations

import torch
from torch import nn

from ..comm import Comm
from ..compress import GradientAverager
from ..flat import group_by_dtype, pack, unpack
from .base import Synchronised, broadcast_module, check_same_model


class DDP(Synchronised):
    name = "ddp"

    def __init__(self, module: nn.Module, optimizer: torch.optim.Optimizer, comm: Comm,
                 compress: str | None = None, error_feedback: bool = False):
        super().__init__(module, optimizer, comm)
        self.averager = GradientAverager(comm, compress, error_feedback)
        for name, p in self.trainable():
            self.averager.check_gradient_dtype(name, p.dtype)
        check_same_model(module, comm)
        broadcast_module(module, comm)

    def sync_gradients(self) -> None:
        """Average every gradient across ranks: one flat all-reduce per dtype.

        A parameter whose ``.grad`` is None (unused in forward) is left out;
        that set must be the same on every rank, as it is for a model without
        data-dependent control flow.
        """
        grads = [p.grad for _, p in self.trainable() if p.grad is not None]
        for key, group in group_by_dtype(grads).items():
            flat = pack(group)
            self.averager(flat, key)
            unpack(flat, group)

"""Broken DDPs, each with one classic bug.  The equivalence suite must catch every one.

They are registered as stages at import (pytest imports this before any rank
pool forks, so the ranks see them too).
"""
from __future__ import annotations

import torch

from minizero.comm import ReduceOp
from minizero.flat import group_by_dtype, pack, unpack
from minizero.stages import STAGES, DDP


class SumInsteadOfMean(DDP):
    """Forgets to divide by the world size."""

    def sync_gradients(self):
        for group in group_by_dtype([p.grad for _, p in self.trainable() if p.grad is not None]).values():
            flat = pack(group)
            self.comm.all_reduce(flat, ReduceOp.SUM)
            unpack(flat, group)


class NoBroadcast(DDP):
    """Trusts every rank to have initialised identically."""

    def __init__(self, module, optimizer, comm):
        self.module, self.optimizer, self.comm = module, optimizer, comm
        self.rank, self.world_size, self.require_backward_grad_sync = comm.rank, comm.world_size, True


class SyncsWeights(DDP):
    """All-reduces the parameters instead of their gradients (the post-accumulate-hook slip)."""

    def sync_gradients(self):
        with torch.no_grad():
            for _, p in self.trainable():
                self.comm.all_reduce(p.data, ReduceOp.AVG)


class DropsLastParameter(DDP):
    """Leaves one parameter out of the flat buffer."""

    def sync_gradients(self):
        grads = [p.grad for _, p in self.trainable() if p.grad is not None][:-1]
        for group in group_by_dtype(grads).values():
            flat = pack(group)
            self.comm.all_reduce(flat, ReduceOp.AVG)
            unpack(flat, group)


class SyncsEveryMicroBatch(DDP):
    """Ignores no_sync: averages after every micro-batch, so earlier micro-batches are divided by N twice."""

    def forward(self, *args, **kwargs):
        output = self.module(*args, **kwargs)
        if torch.is_grad_enabled():
            self._sync_after_backward(output)
        return output


MUTANTS = {"ddp-sum-bug": SumInsteadOfMean, "ddp-no-broadcast": NoBroadcast, "ddp-syncs-weights": SyncsWeights,
           "ddp-drops-param": DropsLastParameter, "ddp-ignores-no-sync": SyncsEveryMicroBatch}
STAGES.update(MUTANTS)

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

    def __init__(self, module, optimizer, comm, **options):
        import minizero.stages.ddp as ddp_module
        skip = ddp_module.broadcast_module
        ddp_module.broadcast_module = lambda *args: None
        try:
            super().__init__(module, optimizer, comm, **options)
        finally:
            ddp_module.broadcast_module = skip


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


from minizero.stages import BucketedDDP  # noqa: E402


class TensorHookDDP(BucketedDDP):
    """Syncs from ``p.register_hook``: it fires *before* the gradient is accumulated into .grad,
    so what gets averaged is this micro-batch's gradient alone.  Right at K=1, wrong at K>=2."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        for _, p in self.trainable():
            p.register_hook(lambda grad, p=p: self._sync_incoming(p, grad))

    def _on_gradient_ready(self, param):  # the correct hook does nothing here
        pass

    def _sync_incoming(self, p, grad):
        if not self._syncing:
            return grad
        averaged = grad.clone()
        self.comm.all_reduce(averaged, ReduceOp.AVG)
        # Overwrite what was accumulated so far with the averaged *last* micro-batch.
        p.grad = None
        return averaged

    def sync_gradients(self):
        pass


class PostHookArgumentAsGradient(BucketedDDP):
    """Treats the post-accumulate hook's argument as the gradient: it is the parameter."""

    def _on_gradient_ready(self, param):
        if self._syncing:
            with torch.no_grad():
                self.comm.all_reduce(param.data, ReduceOp.AVG)

    def sync_gradients(self):
        pass


HOOK_MUTANTS = {"ddp-tensor-hook": TensorHookDDP, "ddp-hook-arg-is-param": PostHookArgumentAsGradient}
STAGES.update(HOOK_MUTANTS)

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
    """Ignores no_sync: averages after every micro-batch.  The values stay right -- averaging is
    linear and the earlier average is the same on every rank -- but it sends K times the bytes."""

    def forward(self, *args, **kwargs):
        self._syncing = True
        output = self.call_module(*args, **kwargs)
        if torch.is_grad_enabled():
            self._hook_backward(output, syncing=True)
        return output


MUTANTS = {"ddp-sum-bug": SumInsteadOfMean, "ddp-no-broadcast": NoBroadcast, "ddp-syncs-weights": SyncsWeights,
           "ddp-drops-param": DropsLastParameter}
STAGES.update(MUTANTS)
STAGES["ddp-ignores-no-sync"] = SyncsEveryMicroBatch  # caught by the ledger, not by the values


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
        self._has_grad.update(id(p) for _, p in self.trainable())  # every parameter was used


class PostHookArgumentAsGradient(BucketedDDP):
    """Treats the post-accumulate hook's argument as the gradient: it is the parameter."""

    def _on_gradient_ready(self, param):
        if self._syncing:
            with torch.no_grad():
                self.comm.all_reduce(param.data, ReduceOp.AVG)

    def sync_gradients(self):
        self._has_grad.update(id(p) for _, p in self.trainable())


HOOK_MUTANTS = {"ddp-tensor-hook": TensorHookDDP, "ddp-hook-arg-is-param": PostHookArgumentAsGradient}
STAGES.update(HOOK_MUTANTS)


from minizero.stages import ZeRO1, ZeRO2  # noqa: E402


class ShiftedShard(ZeRO1):
    """Gives the optimizer the neighbour's slice of the averaged gradient (an off-by-one offset)."""

    def grad_shards(self):
        n = self.world_size
        return [buffer[((self.rank + 1) % n) * g.shard_size:((self.rank + 1) % n + 1) * g.shard_size]
                for g, buffer in zip(self.groups, self.grad_buffers)]


class AllReduceThenAllGather(ZeRO1):
    """Right values, wrong bytes: all-reduces the whole gradient, then all-gathers -- 3 Psi, not 2 Psi."""

    def sync_gradients(self):
        self._refuse_unused_here()
        self._agree_on_use(self._checked_params())
        for buffer in self.grad_buffers:
            self.comm.all_reduce(buffer, ReduceOp.AVG)


class LastMicroBatchOnly(ZeRO2):
    """Frees gradients after every micro-batch, so under accumulation only the last one survives."""

    def _on_gradient_ready(self, param):
        if not self._syncing:
            self._used.add(id(param))
            param.grad = None
            return
        super()._on_gradient_ready(param)


class LocalNorm(ZeRO1):
    """Clips by the norm of this rank's shard instead of the global norm."""

    def clip_grad_norm_(self, max_norm, norm_type=2.0):
        shards = self.grad_shards()
        total = torch.sqrt(sum(s.pow(2).sum() for s in shards))
        for s in shards:
            s.mul_(torch.clamp(max_norm / (total + 1e-6), max=1.0))
        return total


ZERO_MUTANTS = {"zero1-shifted-shard": ShiftedShard, "zero2-last-micro-batch": LastMicroBatchOnly,
                "zero1-local-norm": LocalNorm}
STAGES.update(ZERO_MUTANTS)
STAGES["zero1-allreduce-allgather"] = AllReduceThenAllGather

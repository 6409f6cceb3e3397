"""Known mistakes: stages with one classic bug each, and what the learner did to get it.

They are two things at once.  The suite's mutants -- the property tests must
catch every one (``tests/test_mutants.py``) -- and the labs' diagnoses: when a
learner's stage fails, the checker runs the failing example through each
mistake of the lab and, if one gives the same numbers, says which mistake it
is (:mod:`minizero.course.labs.check`).  Each class's ``mistake`` is that sentence,
in the second person.  They are never in the package's registry; copies of it
name them: :data:`MISTAKE_STAGES` (the suite's mutants) and :data:`LAB_MISTAKES`
(those and the ones only the labs compare with).
"""
from __future__ import annotations

from contextlib import contextmanager

import torch

from ...comm import ReduceOp
from ...compress import Wire
from ...parts.flat import group_by_dtype, pack, unpack
from ...parts.units import Unit
from ...stages import DDP, BucketedDDP, ZeRO1, ZeRO2, ZeRO3, with_stages
from ..harness.registry import LAB_STAGES


class SumInsteadOfMean(DDP):
    """Forgets to divide by the world size."""

    mistake = "you summed the gradients but did not divide by the world size N"
    name = "ddp-sum-bug"

    def post_backward(self):
        for group in group_by_dtype([p.grad for _, p in self.trainable() if p.grad is not None]).values():
            flat = pack(group)
            self.comm.all_reduce(flat, ReduceOp.SUM)
            unpack(flat, group)


class NoBroadcast(DDP):
    """Trusts every rank to have initialised identically."""

    mistake = "the replicas started from different weights: rank 0's parameters were never broadcast"
    name = "ddp-no-broadcast"

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

    mistake = "you averaged the parameters, not their gradients"
    name = "ddp-syncs-weights"

    def post_backward(self):
        with torch.no_grad():
            for _, p in self.trainable():
                self.comm.all_reduce(p.data, ReduceOp.AVG)


class DropsLastParameter(DDP):
    """Leaves one parameter out of the flat buffer."""

    mistake = "one parameter was left out of what you averaged"
    name = "ddp-drops-param"

    def post_backward(self):
        grads = [p.grad for _, p in self.trainable() if p.grad is not None][:-1]
        for group in group_by_dtype(grads).values():
            flat = pack(group)
            self.comm.all_reduce(flat, ReduceOp.AVG)
            unpack(flat, group)


class SyncsEveryMicroBatch(DDP):
    """Ignores no_sync: averages after every micro-batch.  The values stay right -- averaging is
    linear and the earlier average is the same on every rank -- but it sends K times the bytes."""

    mistake = "you synchronised every micro-batch: no_sync() did not stop the all-reduce, so K micro-batches cost K all-reduces"
    name = "ddp-ignores-no-sync"

    @contextmanager
    def no_sync(self):
        yield  # require_backward_grad_sync stays True: every backward's post_backward all-reduces


MUTANTS = {c.name: c for c in (SumInsteadOfMean, NoBroadcast, SyncsWeights, DropsLastParameter)}



class TensorHookDDP(BucketedDDP):
    """Syncs from ``p.register_hook``: it fires *before* the gradient is accumulated into .grad,
    so what gets averaged is this micro-batch's gradient alone.  Right at K=1, wrong at K>=2."""

    mistake = ("you synchronised before the gradient was accumulated (a tensor hook fires before .grad is updated), "
               "so only the last micro-batch was averaged")
    name = "ddp-tensor-hook"

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        for _, p in self.trainable():
            p.register_hook(lambda grad, p=p: self._sync_incoming(p, grad))

    def post_accumulate_grad(self, param):  # the correct hook does nothing here
        pass

    def _sync_incoming(self, p, grad):
        if not self._syncing:
            return grad
        averaged = grad.clone()
        self.comm.all_reduce(averaged, ReduceOp.AVG)
        # Overwrite what was accumulated so far with the averaged *last* micro-batch.
        p.grad = None
        return averaged

    def post_backward(self):
        self._has_grad.update(id(p) for _, p in self.trainable())  # every parameter was used


class PostHookArgumentAsGradient(BucketedDDP):
    """Treats the post-accumulate hook's argument as the gradient: it is the parameter."""

    mistake = "you all-reduced what the post-accumulate-grad hook receives -- the parameter itself -- instead of its .grad"
    name = "ddp-hook-arg-is-param"

    def post_accumulate_grad(self, param):
        if self._syncing:
            with torch.no_grad():
                self.comm.all_reduce(param.data, ReduceOp.AVG)

    def post_backward(self):
        self._has_grad.update(id(p) for _, p in self.trainable())


HOOK_MUTANTS = {c.name: c for c in (TensorHookDDP, PostHookArgumentAsGradient)}



class ShiftedShard(ZeRO1):
    """Gives the optimizer the neighbour's shard of the averaged gradient (an off-by-one shard offset)."""

    mistake = "the optimizer stepped a neighbour's shard of the averaged gradient: the owned shard's offset is off by one rank"
    name = "zero1-shifted-shard"

    def post_backward(self):
        super().post_backward()
        n = self.world_size
        for group, buffer in zip(self.groups, self.full_grads.buffers, strict=True):
            theirs = buffer[((self.rank + 1) % n) * group.shard_size:][:group.shard_size]
            for piece in group.pieces:
                if piece.param.grad is not None:
                    piece.param.grad = theirs[piece.offset:piece.offset + piece.stop - piece.start]


class AllReduceThenAllGather(ZeRO1):
    """Right values, wrong bytes: all-reduces the whole gradient, then all-gathers -- 3 Psi, not 2 Psi."""

    mistake = ("you all-reduced the whole gradient and then all-gathered the parameters: the right values for 1.5x the "
               "bytes; a reduce-scatter is half an all-reduce")
    name = "zero1-allreduce-allgather"

    def post_backward(self):
        try:
            self.refuse_unused_here(self.groups)
            used = self.used_anywhere([s.param for g in self.groups for s in g.segments])
        finally:
            self._used.clear()
        for index, (group, buffer) in enumerate(zip(self.groups, self.full_grads.buffers, strict=True)):
            self.comm.all_reduce(buffer, ReduceOp.AVG, tag=self.tag(f"group {index} gradients"), wire=self.wire,
                                 key=index)
            self.full_grads.take_averaged(index, used)
        self.full_grads.window_open = False


class LastMicroBatchOnly(ZeRO2):
    """Frees gradients after every micro-batch, so under accumulation only the last one survives."""

    mistake = "the full gradients were freed after every micro-batch, so under accumulation only the last one was reduced"
    name = "zero2-last-micro-batch"

    def post_accumulate_grad(self, param):
        if not self._syncing:
            self._used.add(id(param))
            param.grad = None
            return
        super().post_accumulate_grad(param)


class LocalNorm(ZeRO1):
    """Clips by the norm of this rank's shard instead of the global norm."""

    mistake = "you clipped by the norm of this rank's shard instead of the global norm"
    name = "zero1-local-norm"

    def clip_grad_norm_(self, max_norm, norm_type=2.0):
        grads = [piece.param.grad for piece in self.pieces() if piece.param.grad is not None]
        total = torch.sqrt(sum(g.pow(2).sum() for g in grads))
        for g in grads:
            g.mul_(torch.clamp(max_norm / (total + 1e-6), max=1.0))
        return total


ZERO_MUTANTS = {c.name: c for c in (ShiftedShard, LastMicroBatchOnly, LocalNorm)}


#: The lab's registry plus every mistake: a copy; the package's registry never sees them.
MISTAKE_STAGES = with_stages(*MUTANTS.values(), *HOOK_MUTANTS.values(), *ZERO_MUTANTS.values(), SyncsEveryMicroBatch,
                             AllReduceThenAllGather, base=LAB_STAGES)


class _GathersOnceUnit(Unit):
    def post_forward(self, reshard: bool) -> None:
        pass  # keeps the full parameters from forward to backward


class NeverReshards(ZeRO3):
    """Keeps each unit gathered from its forward to its backward, whatever ``reshard_after_forward`` says."""

    mistake = ("your units were not freed after their forward (reshard), so backward needed no second all-gather: "
               "two-thirds of ZeRO-3's bytes, for the memory of the whole model between forward and backward")
    name = "zero3-never-reshards"
    unit_class = _GathersOnceUnit


class _StaleUnit(Unit):
    def post_backward(self, group) -> None:
        pass  # the full buffer outlives the step: the next forward uses the old weights


class StaleAfterBackward(ZeRO3):
    """Never frees a group after its backward: the next forward finds it gathered and computes with the
    weights of before the optimizer step."""

    mistake = ("a unit's full parameters were not freed after its backward, so the next forward found them "
               "gathered and computed with the weights of before the optimizer step")
    name = "zero3-stale-after-backward"
    unit_class = _StaleUnit


class _DividesAfterCast(Wire):
    def encode(self, flat, key=None):
        return flat.to(self.wire_dtype).div_(self.comm.world_size)  # 16-bit division by N: a rounding of its own

    def decode(self, wire, out, key=None, where="a gradient buffer") -> None:
        out.copy_(wire.to(out.dtype))  # the sum of the N-th parts is already the mean


class FP16HookDivision(DDP):
    """Divides as torch's ``fp16_compress_hook`` does: cast, then divide by N in 16 bits, then sum."""

    mistake = ("you cast to 16 bits and then divided by N in 16 bits (torch's fp16_compress_hook's order): a second "
               "rounding before the sum, which the reference -- dividing by a power of two, exactly -- does not make")
    name = "ddp-fp16-hook-division"

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        if self.wire is not None:
            self.wire = _DividesAfterCast(self.comm, self.wire.wire_dtype)


LAB_MISTAKES = with_stages(NeverReshards, StaleAfterBackward, FP16HookDivision, base=MISTAKE_STAGES)

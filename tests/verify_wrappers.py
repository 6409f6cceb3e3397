"""Wrappers written here, as a course's student would, for ``tests/test_verify.py``: one right, and each wrong in
one way a student's first DDP often is."""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from minizero.course.verify import Wrapped


class StudentDDP(nn.Module):
    """CS336's shape: broadcast at wrap time, all-reduce every gradient in ``finish_gradient_synchronization()``."""

    def __init__(self, module: nn.Module, divide: bool = True, broadcast: bool = True):
        super().__init__()
        self.module, self.divide = module, divide
        if broadcast:
            for tensor in module.state_dict().values():
                dist.broadcast(tensor, 0)

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def finish_gradient_synchronization(self) -> None:
        for p in self.module.parameters():
            if p.grad is not None:
                dist.all_reduce(p.grad)
                if self.divide:
                    p.grad /= dist.get_world_size()


def student_ddp(module, group):
    wrapper = StudentDDP(module)
    return Wrapped(wrapper, before_step=wrapper.finish_gradient_synchronization)


def sums_without_dividing(module, group):
    wrapper = StudentDDP(module, divide=False)
    return Wrapped(wrapper, before_step=wrapper.finish_gradient_synchronization)


def not_a_module(module, group):
    return [module]


def raises_on_rank_1(module, group):
    if dist.get_rank() == 1:
        raise RuntimeError("rank 1 could not wrap")
    return StudentDDP(module)


def never_finishes(module):
    return Wrapped(StudentDDP(module), before_step=lambda: torch.ones(1).sum() if dist.get_rank() == 0 else _spin())


def _spin():
    while True:
        pass


class StudentShardedOptimizer(torch.optim.Optimizer):
    """CS336's second shape: each rank keeps the optimizer state of the parameters it owns (every N-th, in order),
    steps them, and broadcasts each parameter from its owner.  ``owner_sends=False``: every parameter is broadcast
    from rank 0 -- the slip of a first version."""

    def __init__(self, params, optimizer_cls, owner_sends: bool = True, **defaults):
        super().__init__(params, defaults)
        self.rank, self.world_size, self.owner_sends = dist.get_rank(), dist.get_world_size(), owner_sends
        self.everything = [p for group in self.param_groups for p in group["params"]]
        owned = {id(p) for i, p in enumerate(self.everything) if i % self.world_size == self.rank}
        self.local = optimizer_cls([{**{k: v for k, v in g.items() if k != "params"},
                                     "params": [p for p in g["params"] if id(p) in owned]} for g in self.param_groups],
                                   **defaults)

    @torch.no_grad()
    def step(self, closure=None):
        self.local.step()
        for i, p in enumerate(self.everything):
            dist.broadcast(p.data, i % self.world_size if self.owner_sends else 0)


def _sharded(built: torch.optim.Optimizer, owner_sends: bool) -> torch.optim.Optimizer:
    defaults = {k: v for k, v in built.defaults.items() if k in ("lr", "momentum", "betas", "weight_decay", "nesterov",
                                                                 "eps", "dampening")}
    return StudentShardedOptimizer([dict(g) for g in built.param_groups], type(built), owner_sends, **defaults)


def student_ddp_sharded_optimizer(module, group):
    wrapper = StudentDDP(module)
    return Wrapped(wrapper, before_step=wrapper.finish_gradient_synchronization,
                   optimizer=lambda built: _sharded(built, owner_sends=True))


def sharded_optimizer_broadcasts_from_rank_0(module, group):
    wrapper = StudentDDP(module)
    return Wrapped(wrapper, before_step=wrapper.finish_gradient_synchronization,
                   optimizer=lambda built: _sharded(built, owner_sends=False))


def zero3_read_from_placeholders(module, group):
    """minizero's zero3, its full parameters read from the module -- where ZeRO-3 leaves 0-element placeholders."""
    from minizero.comm import make_comm
    from minizero.stages import make_stage
    stage = make_stage("zero3", module, comm=make_comm("native", group=group))
    return Wrapped(stage, full_parameters=lambda: dict(module.named_parameters()))


class HookDDP(nn.Module):
    """A DDP by hooks, with ``no_sync()``: a synchronising backward averages each gradient once it is accumulated
    -- ``.grad`` then holds what earlier synchronising backwards averaged plus this rank's gradients since, and the
    mean of that is their average plus the mean of these.  ``once_per_step``: a student's saving -- a parameter
    averaged once this step is not averaged again -- which is right while only the last micro-batch synchronises."""

    def __init__(self, module: nn.Module, once_per_step: bool = False):
        super().__init__()
        self.module, self.once_per_step = module, once_per_step
        self.syncing, self.averaged = True, set()
        for tensor in module.state_dict().values():
            dist.broadcast(tensor, 0)
        for p in module.parameters():
            if p.requires_grad:
                p.register_post_accumulate_grad_hook(self._average)

    def _average(self, p: torch.Tensor) -> None:
        if not self.syncing or (self.once_per_step and id(p) in self.averaged):
            return
        dist.all_reduce(p.grad)
        p.grad /= dist.get_world_size()
        self.averaged.add(id(p))

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def no_sync(self):
        wrapper = self

        class _Off:
            def __enter__(self):
                wrapper.syncing = False

            def __exit__(self, *exc):
                wrapper.syncing = True
        return _Off()

    def new_step(self) -> None:
        self.averaged.clear()


def hook_ddp(module, group):
    wrapper = HookDDP(module)
    return Wrapped(wrapper, before_step=wrapper.new_step)


def averages_once_per_step(module, group):
    wrapper = HookDDP(module, once_per_step=True)
    return Wrapped(wrapper, before_step=wrapper.new_step)


# ---------------------------------------------------------------- 16-bit wires, declared (docs/verify.md)
def _sixteen_bit_hook(dtype: torch.dtype, divide: bool, summed_wide: bool = False):
    """torch's compress hook, written out: cast the bucket to ``dtype``, divide by N there (unless ``divide`` is
    False: the planted slip), all-reduce, copy back into the bucket.  ``summed_wide``: rounded to ``dtype`` but
    sent and summed in the bucket's own dtype (another slip)."""
    def hook(group, bucket):
        n = dist.get_world_size(group)
        wire = bucket.buffer().to(dtype)
        if summed_wide:
            wire = wire.to(bucket.buffer().dtype)
        if divide:
            wire.div_(n)
        work = dist.all_reduce(wire, group=group, async_op=True).get_future()

        def back(fut):
            out = bucket.buffer()
            out.copy_(fut.value()[0])
            return out
        return work.then(back)
    return hook


def _ddp_with_hook(module, group, hook, declared: str):
    from torch.nn.parallel import DistributedDataParallel
    wrapped = DistributedDataParallel(module, process_group=group)
    wrapped.register_comm_hook(group, hook)
    return Wrapped(wrapped, compress=declared)


def fp16_hook_without_division(module, group):
    """Declares fp16, casts to fp16, forgets to divide by N: the sum, not the mean."""
    return _ddp_with_hook(module, group, _sixteen_bit_hook(torch.float16, divide=False), "fp16")


def bf16_hook_declared_fp16(module, group):
    """Declares fp16 and rounds to bfloat16: every gradient 8x coarser than the wire it says it has."""
    return _ddp_with_hook(module, group, _sixteen_bit_hook(torch.bfloat16, divide=True), "fp16")


def declares_an_int8_wire(module, group):
    from torch.nn.parallel import DistributedDataParallel
    return Wrapped(DistributedDataParallel(module, process_group=group), compress="int8")


def bf16_hook(module, group):
    """torch's ``bf16_compress_hook``, written out: torch's own refuses gloo (it requires CUDA and NCCL)."""
    return _ddp_with_hook(module, group, _sixteen_bit_hook(torch.bfloat16, divide=True), "bf16")


def fp16_hook_undeclared(module, group):
    """torch's fp16 hook, its wire not declared: judged against exact training."""
    return Wrapped(_ddp_with_hook(module, group, _sixteen_bit_hook(torch.float16, divide=True), "fp16").module)


def rounds_to_fp16_but_sums_in_fp32(module, group):
    """Declares fp16; rounds each gradient to fp16, but sends and sums it at full width -- the sum is never rounded to 16
    bits: within a few roundings of the fp16 wire everywhere, and not it (at N = 2, one sum apart)."""
    return _ddp_with_hook(module, group, _sixteen_bit_hook(torch.float16, divide=True, summed_wide=True), "fp16")


def fsdp2_bf16_summing(module, group):
    """FSDP2 under ``MixedPrecisionPolicy(bf16, fp32)`` whose reduced gradients are multiplied back by N before the
    step: the sum over ranks, not the mean (``set_gradient_divide_factor(1.0)`` says the same, on NCCL only)."""
    from minizero.course.verify.torch_wrappers import fsdp2_bf16_local_clip
    wrapped = fsdp2_bf16_local_clip(module, group)

    def summed():
        for p in wrapped.module.parameters():
            if p.grad is not None:
                p.grad.mul_(dist.get_world_size(group))
    wrapped.before_step = summed
    return wrapped


def fsdp2_fp32_declared_bf16(module, group):
    """FSDP2 computing in fp32, declaring bf16 compute: within the bound of the drawn examples (it rounds nothing),
    not the casts it declares."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    from minizero.course.verify.torch_wrappers import clipping_local_shards, fsdp2
    wrapped = fsdp2(module, group)
    return Wrapped(wrapped, precision=MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32),
                   clip_grad_norm=clipping_local_shards(wrapped, group))


def fsdp2_bf16_undeclared(module, group):
    """FSDP2 under ``MixedPrecisionPolicy(bf16, fp32)`` with the policy not declared: judged as full-width training."""
    from minizero.course.verify.torch_wrappers import fsdp2_bf16_local_clip
    wrapped = fsdp2_bf16_local_clip(module, group)
    wrapped.precision = None
    return wrapped

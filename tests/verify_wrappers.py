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

"""Lab ``compress`` in another style: ``no_sync()`` returns an object with ``__enter__`` and ``__exit__`` (as torch's
own ``DistributedDataParallel.no_sync`` was written before it became a generator), and the wire is two one-liners
over ``torch.div`` and ``Tensor.copy_`` -- the same casts in the same order as the contract asks."""
from __future__ import annotations

import torch

from minizero.course.labs.skeletons.contract.compress import DDP as ContractDDP
from minizero.course.labs.skeletons.contract.compress import Wire as ContractWire


class Wire(ContractWire):
    def encode(self, flat: torch.Tensor, key=None) -> torch.Tensor:
        return torch.div(flat, self.pre).to(self.wire_dtype)

    def decode(self, wire: torch.Tensor, out: torch.Tensor, key=None, where: str = "a gradient buffer") -> None:
        out.copy_(wire)  # the cast to out's dtype
        out.div_(self.post)


class Suspended:
    """While inside: the stage's backwards synchronise nothing; on leaving (an exception too, nested or not): as
    before entering."""

    def __init__(self, ddp):
        self.ddp = ddp

    def __enter__(self):
        self.before, self.ddp.require_backward_grad_sync = self.ddp.require_backward_grad_sync, False
        return self.ddp

    def __exit__(self, *exc) -> bool:
        self.ddp.require_backward_grad_sync = self.before
        return False


class DDP(ContractDDP):
    wire_class = Wire

    def no_sync(self):
        return Suspended(self)

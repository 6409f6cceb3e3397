"""Lab ``ddp`` as lesson 3's first exercise writes it: one all-reduce per parameter, no flat buffer.  The bytes are
one ring all-reduce of every gradient, as the contract asks; the messages, one per parameter per ring step, are not
judged (the contract says so)."""
from __future__ import annotations

import torch

from minizero.comm import ReduceOp
from minizero.course.labs.skeletons.contract.ddp import DDP as Contract


class DDP(Contract):
    def post_backward(self) -> None:
        params = list(dict.fromkeys(p for p in self.module.parameters() if p.requires_grad))
        if self.find_unused_parameters:
            anywhere = torch.tensor([float(p.grad is not None) for p in params])
            self.comm.all_reduce(anywhere, ReduceOp.MAX)
        else:
            anywhere = torch.ones(len(params))
        for index, (p, used) in enumerate(zip(params, anywhere.tolist(), strict=True)):
            if not used:
                continue
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            grad = p.grad.reshape(-1).clone()  # contiguous, whatever the .grad's strides
            self.comm.all_reduce(grad, ReduceOp.AVG, wire=self.wire, key=index)
            p.grad.copy_(grad.view_as(p.grad))

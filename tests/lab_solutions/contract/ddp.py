"""Lab ``ddp`` written from the contract skeleton alone (``tests/test_labs.py`` checks it passes)."""
from __future__ import annotations

import torch

from minizero.comm import ReduceOp
from minizero.course.labs.skeletons.contract.ddp import DDP as Contract


class DDP(Contract):
    def post_backward(self) -> None:
        params = [p for p in self.module.parameters() if p.requires_grad]  # tied ones once
        here = [p.grad is not None for p in params]
        if self.find_unused_parameters:  # has it a gradient on any rank? the same answer everywhere
            flags = torch.tensor([float(h) for h in here])
            self.comm.all_reduce(flags, ReduceOp.MAX)
            here = [f > 0 for f in flags.tolist()]
        elif not all(here):
            raise RuntimeError(f"rank {self.rank}: a trainable parameter got no gradient")
        synced = []
        for p, anywhere in zip(params, here, strict=True):
            if anywhere:
                if p.grad is None:
                    p.grad = torch.zeros_like(p)  # this rank's share of a mean that exists elsewhere
                synced.append(p)
        for dtype in dict.fromkeys(p.grad.dtype for p in synced):
            grads = [p.grad for p in synced if p.grad.dtype == dtype]
            flat = torch.cat([g.reshape(-1) for g in grads])
            self.comm.all_reduce(flat, ReduceOp.AVG, wire=self.wire, key=dtype)
            for g, mean in zip(grads, flat.split([g.numel() for g in grads]), strict=True):
                g.copy_(mean.view_as(g))

"""Averages every parameter in one flat buffer: ``torch.cat`` promotes a float32 parameter beside a float64 one to
float64, so the ranks send 8 bytes for each of its elements.  The values pass float32's tolerance."""
from __future__ import annotations

import torch

from minizero.comm import ReduceOp
from minizero.course.labs.skeletons.contract import local_sgd as contract


class LocalSGD(contract.LocalSGD):
    def step(self) -> None:
        with self.stepping():
            self.optimizer_step()
            if (self.steps_taken + 1) % self.average_every == 0:
                self.average()

    @torch.no_grad()
    def average(self) -> None:
        params = [p for _, p in self.trainable()]
        flat = torch.cat([p.detach().reshape(-1) for p in params])  # one message -- in the promoted dtype
        self.comm.all_reduce(flat, ReduceOp.AVG, tag=self.tag("the parameters, averaged"))
        at = 0
        for p in params:
            p.copy_(flat[at:at + p.numel()].view_as(p))
            at += p.numel()
        if self.outer is not None:
            for anchor, p in zip(self.anchor, params, strict=True):
                anchor.grad = anchor.detach() - p
            self.outer.step()
            for anchor, p in zip(self.anchor, params, strict=True):
                p.copy_(anchor)

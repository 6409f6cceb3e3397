"""Averages every parameter of the module -- ``module.parameters()``, frozen ones too -- instead of the trainable
ones: the same values (a frozen parameter is the same on every rank), but bytes the formula does not count."""
from __future__ import annotations

import torch

from minizero.comm import ReduceOp
from minizero.course.labs import given
from minizero.parts.flat import group_by_dtype, pack, unpack


class LocalSGD(given.LocalSGD):
    def step(self) -> None:
        with self.stepping():
            self.optimizer_step()
            if (self.steps_taken + 1) % self.average_every == 0:
                self.average()

    @torch.no_grad()
    def average(self) -> None:
        params = [p for _, p in self.trainable()]
        everything = list(self.module.parameters())
        for group in group_by_dtype(everything).values():
            flat = pack([p.detach() for p in group])
            self.comm.all_reduce(flat, ReduceOp.AVG, tag=self.tag("parameters, averaged"))
            unpack(flat, group)
        if self.outer is not None:
            for anchor, p in zip(self.anchor, params, strict=True):
                anchor.grad = anchor.detach() - p
            self.outer.step()
            for anchor, p in zip(self.anchor, params, strict=True):
                p.copy_(anchor)

"""Lab ``local-sgd`` filled in from the guided skeleton's docstrings (``tests/test_lab_local_sgd.py`` checks it
passes)."""
from __future__ import annotations

import torch

from minizero.comm import ReduceOp
from minizero.course.labs.skeletons.guided import local_sgd as skeleton
from minizero.parts.flat import group_by_dtype, pack, unpack


class LocalSGD(skeleton.LocalSGD):
    def step(self) -> None:
        with self.stepping():
            self.optimizer_step()
            if (self.steps_taken + 1) % self.average_every == 0:
                self.average()

    @torch.no_grad()
    def average(self) -> None:
        params = [p for _, p in self.trainable()]
        for group in group_by_dtype(params).values():
            flat = pack([p.detach() for p in group])
            self.comm.all_reduce(flat, ReduceOp.AVG, tag=self.tag("parameters, averaged"))
            unpack(flat, group)
        if self.outer is not None:
            for anchor, p in zip(self.anchor, params, strict=True):
                anchor.grad = anchor - p
            self.outer.step()
            for anchor, p in zip(self.anchor, params, strict=True):
                p.copy_(anchor)

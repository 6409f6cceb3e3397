"""Lab ``local-sgd`` in another style: the step counted from ``steps_taken`` by remainder, the parameters packed
with ``torch.cat`` and unpacked with ``split``, summed with ``ReduceOp.SUM`` and divided afterwards, and DiLoCo's
outer gradients made with ``torch._foreach_sub`` -- none of it the package's helpers."""
from __future__ import annotations

import torch

from minizero.comm import ReduceOp
from minizero.course.labs.skeletons.contract.local_sgd import LocalSGD as Contract


class LocalSGD(Contract):
    def step(self) -> None:
        with self.stepping():
            self.optimizer_step()
            if self.steps_taken % self.average_every == self.average_every - 1:
                self.average()

    @torch.no_grad()
    def average(self) -> None:
        params = [p for _, p in self.trainable()]
        by_dtype: dict = {}
        for p in params:
            by_dtype.setdefault(p.dtype, []).append(p)
        for group in by_dtype.values():
            flat = torch.cat([p.reshape(-1) for p in group])
            self.comm.all_reduce(flat, ReduceOp.SUM, tag=self.tag("parameters, averaged"))
            flat /= self.comm.world_size
            for p, piece in zip(group, flat.split([p.numel() for p in group]), strict=True):
                p.copy_(piece.view_as(p))
        if self.outer is not None:
            for anchor, moved in zip(self.anchor, torch._foreach_sub([a.detach() for a in self.anchor], params),
                                     strict=True):
                anchor.grad = moved
            self.outer.step()
            for anchor, p in zip(self.anchor, params, strict=True):
                p.copy_(anchor)

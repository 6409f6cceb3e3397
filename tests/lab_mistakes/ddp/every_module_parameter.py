"""Averages ``self.module.parameters()`` -- frozen and unused parameters too, whose ``.grad`` is None."""
from __future__ import annotations

from minizero.comm import ReduceOp
from minizero.course.labs import given
from minizero.parts.flat import group_by_dtype, pack, unpack


class DDP(given.DDP):
    def post_backward(self) -> None:
        for dtype, grads in group_by_dtype([p.grad for p in self.module.parameters()]).items():
            flat = pack(grads)
            self.comm.all_reduce(flat, ReduceOp.AVG, tag=self.tag(f"gradients ({dtype})"), wire=self.wire, key=dtype)
            unpack(flat, grads)

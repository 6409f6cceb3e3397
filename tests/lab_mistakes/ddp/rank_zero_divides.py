"""Sums the gradients and lets rank 0 divide by N ("the root averages"): the other ranks keep the sum."""
from __future__ import annotations

from minizero.comm import ReduceOp
from minizero.course.labs import given
from minizero.parts.flat import group_by_dtype, pack, unpack


class DDP(given.DDP):
    def post_backward(self) -> None:
        for dtype, grads in group_by_dtype([p.grad for p in self._with_gradient()]).items():
            flat = pack(grads)
            self.comm.all_reduce(flat, ReduceOp.SUM, tag=self.tag(f"gradients ({dtype})"), wire=self.wire, key=dtype)
            if self.rank == 0:
                flat /= self.world_size
            unpack(flat, grads)

"""Averages only the first dtype's flat buffer (a model of one dtype hides it)."""
from __future__ import annotations

from minizero.comm import ReduceOp
from minizero.course.labs import given
from minizero.parts.flat import group_by_dtype, pack, unpack


class DDP(given.DDP):
    def post_backward(self) -> None:
        groups = group_by_dtype([p.grad for p in self._with_gradient()])
        dtype, grads = next(iter(groups.items()))  # "one flat buffer"
        flat = pack(grads)
        self.comm.all_reduce(flat, ReduceOp.AVG, tag=self.tag(f"gradients ({dtype})"), wire=self.wire, key=dtype)
        unpack(flat, grads)

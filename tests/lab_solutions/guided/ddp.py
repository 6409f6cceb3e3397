"""Lab ``ddp`` filled in from the guided skeleton's docstrings alone (``tests/test_labs.py`` checks it passes)."""
from __future__ import annotations

from minizero.comm import ReduceOp
from minizero.course.labs.skeletons.guided.ddp import DDP as Skeleton
from minizero.parts.flat import group_by_dtype, pack, unpack


class DDP(Skeleton):
    def post_backward(self) -> None:
        for dtype, grads in group_by_dtype([p.grad for p in self._with_gradient()]).items():
            flat = pack(grads)
            self.comm.all_reduce(flat, ReduceOp.AVG, tag=self.tag(f"gradients ({dtype})"), wire=self.wire, key=dtype)
            unpack(flat, grads)

"""Lab ``ddp`` filled in from the skeleton's docstrings alone (``tests/test_labs.py`` checks it passes)."""
from __future__ import annotations

from minizero.comm import ReduceOp
from minizero.flat import group_by_dtype, pack, unpack
from minizero.labs.skeletons.ddp import DDP as Skeleton


class DDP(Skeleton):
    def sync_gradients(self) -> None:
        for grads in group_by_dtype([p.grad for p in self._with_gradient()]).values():
            flat = pack(grads)
            self.comm.all_reduce(flat, ReduceOp.SUM, tag=self.tag("gradients"))
            flat.div_(self.world_size)
            unpack(flat, grads)

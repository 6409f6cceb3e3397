"""Lab ``zero2`` naming the buckets by the ZeRO base's word, ``self.groups`` (the same list as ``self.buckets``), and
launching through a bound method and ``functools.partial`` instead of a closure."""
from __future__ import annotations

from functools import partial

import torch

from minizero.comm import ReduceOp
from minizero.course.labs.skeletons.contract.zero2 import ZeRO2 as Contract


class ZeRO2(Contract):
    def post_accumulate_grad(self, param) -> None:
        self._used.add(id(param))
        if self._syncing:
            self.pipeline.mark(param)

    def _reduce_scatter_now(self, index: int, full: torch.Tensor) -> torch.Tensor:
        averaged = torch.empty_like(self.groups[index].shard)
        self.comm.reduce_scatter(averaged, full, ReduceOp.AVG, wire=self.wire, key=index)
        return averaged

    def deferred_reduce_scatter(self, index: int):
        return partial(self._reduce_scatter_now, index, self.groups[index].take_gradients())

    def post_backward(self) -> None:
        with self.pipeline.round():
            self.pipeline.launch_rest()
            used = self.used_anywhere([s.param for group in self.groups for s in group.segments])
            for index, averaged in self.pipeline.wait_all():
                self.accumulate(self.groups[index], averaged, used)

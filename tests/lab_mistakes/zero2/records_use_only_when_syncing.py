"""Records that a parameter has a gradient only in a synchronising backward: a branch that only micro-batches inside
``no_sync()`` used is then unused everywhere, and loses its gradient (issue 45)."""
from __future__ import annotations

import torch

from minizero.comm import ReduceOp
from minizero.course.labs import given


class ZeRO2(given.ZeRO2):
    def post_accumulate_grad(self, param) -> None:
        if self._syncing:
            self._used.add(id(param))
            self.pipeline.mark(param)

    def deferred_reduce_scatter(self, index: int):
        bucket, tag = self.buckets[index], self.tag(f"bucket {index}")
        full = bucket.take_gradients()

        def reduce_scatter():
            averaged = torch.empty_like(bucket.shard)
            self.comm.reduce_scatter(averaged, full, ReduceOp.AVG, tag=tag, wire=self.wire, key=index)
            return averaged

        return reduce_scatter

    def post_backward(self) -> None:
        with self.pipeline.round():
            self.pipeline.launch_rest()
            used = self.used_anywhere([s.param for bucket in self.buckets for s in bucket.segments])
            for index, averaged in self.pipeline.wait_all():
                self.accumulate(self.buckets[index], averaged, used)

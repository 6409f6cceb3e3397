"""Gives each piece its range of the averaged shard as a new ``.grad`` -- replacing, not adding to, what an earlier
synchronising backward of the same step left there: right whenever one backward per step synchronises, wrong after
two (the first one's average is lost)."""
from __future__ import annotations

import torch

from minizero.comm import ReduceOp
from minizero.course.labs import given


class ZeRO2(given.ZeRO2):
    def post_accumulate_grad(self, param) -> None:
        self._used.add(id(param))
        if self._syncing:
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
                for piece in self.buckets[index].pieces:
                    if id(piece.segment.param) in used:
                        piece.param.grad = averaged[piece.offset:piece.offset + piece.stop - piece.start]

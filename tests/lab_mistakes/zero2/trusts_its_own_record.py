"""Gives a piece its averaged gradient if *this rank* used the parameter -- its own record, not the one agreed
across ranks (``used_anywhere``): a branch used on another rank only gets no gradient here, and every rank's step
differs from one device's without an error (0.02 off on the routed model; issue 45)."""
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
            used = {id(s.param) for bucket in self.buckets for s in bucket.segments if id(s.param) in self._used}
            self._used.clear()
            for index, averaged in self.pipeline.wait_all():
                self.accumulate(self.buckets[index], averaged, used)

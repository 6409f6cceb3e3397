"""Reduce-scatters each bucket in float64 "for accuracy": right to float32's tolerance, twice the bytes of a float32
model."""
from __future__ import annotations

import torch

from minizero.comm import ReduceOp
from minizero.course.labs.skeletons.contract.zero2 import ZeRO2 as Contract


class ZeRO2(Contract):
    def post_accumulate_grad(self, param) -> None:
        self._used.add(id(param))
        if self._syncing:
            self.pipeline.mark(param)

    def deferred_reduce_scatter(self, index: int):
        bucket = self.buckets[index]
        flat = bucket.shard.new_zeros(bucket.shard_size * self.world_size)
        for s in bucket.segments:
            if s.param.grad is not None:
                flat[s.start:s.stop] = s.param.grad.reshape(-1)
                s.param.grad = None  # no full gradient outlives its bucket's launch

        def reduce_scatter() -> torch.Tensor:
            mine = flat.new_empty(bucket.shard_size, dtype=torch.float64)  # "for accuracy": 8 bytes an element
            self.comm.reduce_scatter(mine, flat.double(), ReduceOp.AVG, wire=self.wire, key=index)
            return mine.to(bucket.shard.dtype)

        return reduce_scatter

    def post_backward(self) -> None:
        with self.pipeline.round():  # nothing left running or marked, whatever happens
            self.pipeline.launch_rest()
            params = [s.param for bucket in self.buckets for s in bucket.segments]
            here = [id(p) in self._used for p in params]
            self._used.clear()
            if self.find_unused_parameters:  # after every bucket's reduce-scatter was issued
                flags = torch.tensor([float(h) for h in here])
                self.comm.all_reduce(flags, ReduceOp.MAX)
                here = [f > 0 for f in flags.tolist()]
            anywhere = {id(p) for p, h in zip(params, here, strict=True) if h}
            self._has_grad.update(anywhere)
            for index, mine in self.pipeline.wait_all():
                for piece in self.buckets[index].pieces:
                    if id(piece.segment.param) in anywhere:
                        grad = mine[piece.offset:piece.offset + piece.stop - piece.start]
                        piece.param.grad = grad if piece.param.grad is None else piece.param.grad.add_(grad)

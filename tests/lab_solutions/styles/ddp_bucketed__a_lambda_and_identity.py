"""Lab ``ddp-bucketed`` in another style: the collective handed back as a lambda, the gradient's place in its bucket
tested by identity (``is``), and the use recorded first."""
from __future__ import annotations

import torch

from minizero.comm import ReduceOp
from minizero.course.labs.skeletons.contract.ddp_bucketed import BucketedDDP as Contract


class BucketedDDP(Contract):
    def post_accumulate_grad(self, param) -> None:
        self._used.add(id(param))
        bucket, i = self._slot[id(param)]
        view = bucket.views[i]
        with torch.no_grad():
            if param.grad is None:
                view.fill_(0)
            elif param.grad is not view:
                view.copy_(param.grad)
        param.grad = view
        if self._syncing:
            self.pipeline.mark(param)

    def deferred_all_reduce(self, index: int):
        buffer = self.buckets[index].buffer
        return lambda: self.comm.all_reduce(buffer, ReduceOp.AVG, wire=self.wire, key=index)

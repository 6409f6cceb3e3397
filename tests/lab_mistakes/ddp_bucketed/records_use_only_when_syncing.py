"""Records that a parameter has a gradient only in a synchronising backward (inside the ``if self._syncing``): a
branch that only micro-batches inside ``no_sync()`` used is then unused everywhere, and loses its gradient (0.21 off
on the routed model; issue 45)."""
from __future__ import annotations

from minizero.comm import ReduceOp
from minizero.course.labs import given
from minizero.parts.flat import keep_grad_in


class BucketedDDP(given.BucketedDDP):
    def post_accumulate_grad(self, param) -> None:
        bucket, i = self._slot[id(param)]
        keep_grad_in(param, bucket.views[i])
        if self._syncing:
            self._used.add(id(param))
            self.pipeline.mark(param)

    def deferred_all_reduce(self, index: int):
        bucket, tag = self.buckets[index], self.tag(f"bucket {index}")
        return lambda: self.comm.all_reduce(bucket.buffer, ReduceOp.AVG, tag=tag, wire=self.wire, key=index)

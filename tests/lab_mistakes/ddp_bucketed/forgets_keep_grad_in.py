"""Records the gradient and marks it ready, but never puts it back into its bucket's view (``keep_grad_in``)."""
from __future__ import annotations

from minizero.comm import ReduceOp
from minizero.course.labs import given


class BucketedDDP(given.BucketedDDP):
    def post_accumulate_grad(self, param) -> None:
        self._used.add(id(param))  # .grad is a view into the bucket -- until a user's zero_grad() sets it to None
        if self._syncing:
            self.pipeline.mark(param)

    def deferred_all_reduce(self, index: int):
        bucket, tag = self.buckets[index], self.tag(f"bucket {index}")
        return lambda: self.comm.all_reduce(bucket.buffer, ReduceOp.AVG, tag=tag, wire=self.wire, key=index)

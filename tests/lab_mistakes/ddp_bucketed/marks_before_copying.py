"""Marks the parameter ready, then copies its gradient into the bucket: the bucket may be launched -- and the
communication thread reduce it -- before the copy, a race that most runs win (3e-5 off in the others).  The checker
runs one case with every collective reduced the moment it is launched, where it loses every time (issue 45)."""
from __future__ import annotations

from minizero.comm import ReduceOp
from minizero.course.labs import given
from minizero.parts.flat import keep_grad_in


class BucketedDDP(given.BucketedDDP):
    def post_accumulate_grad(self, param) -> None:
        bucket, i = self._slot[id(param)]
        self._used.add(id(param))
        if self._syncing:
            self.pipeline.mark(param)
        keep_grad_in(param, bucket.views[i])

    def deferred_all_reduce(self, index: int):
        bucket, tag = self.buckets[index], self.tag(f"bucket {index}")
        return lambda: self.comm.all_reduce(bucket.buffer, ReduceOp.AVG, tag=tag, wire=self.wire, key=index)

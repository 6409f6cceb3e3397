"""Reduce-scatters only ``self.groups[0]`` ("one flat buffer"): a second param group or dtype is never averaged."""
from __future__ import annotations

from minizero.comm import ReduceOp
from minizero.course.labs import given


class ZeRO1(given.ZeRO1):
    def post_backward(self) -> None:
        used = self.used_anywhere([s.param for group in self.groups for s in group.segments])
        group, buffer = self.groups[0], self.full_grads.buffers[0]
        self.comm.reduce_scatter(group.shard_of(buffer), buffer, ReduceOp.AVG, tag=self.tag("group 0 gradients"),
                                 wire=self.wire, key=0)
        self.full_grads.take_averaged(0, used)
        self.full_grads.window_open = False

    def all_gather_parameters(self) -> None:
        for g, group in enumerate(self.groups):
            self.comm.all_gather(group.data, group.shard.detach().clone(), tag=self.tag(f"group {g} parameters"))
        self.remember_shared()

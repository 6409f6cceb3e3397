"""Reduce-scatters into the owned shard but never hands it to the pieces (``take_averaged``): the optimizer sees no gradient."""
from __future__ import annotations

from minizero.comm import ReduceOp
from minizero.course.labs import given


class ZeRO1(given.ZeRO1):
    def post_backward(self) -> None:
        for index, (group, buffer) in enumerate(zip(self.groups, self.full_grads.buffers, strict=True)):
            self.comm.reduce_scatter(group.shard_of(buffer), buffer, ReduceOp.AVG,
                                     tag=self.tag(f"group {index} gradients"), wire=self.wire, key=index)
        self.full_grads.window_open = False

    def all_gather_parameters(self) -> None:
        for g, group in enumerate(self.groups):
            self.comm.all_gather(group.data, group.shard.detach().clone(), tag=self.tag(f"group {g} parameters"))
        self.remember_shared()

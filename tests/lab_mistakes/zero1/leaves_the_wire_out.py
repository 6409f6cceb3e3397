"""Reduce-scatters every group right -- but without ``wire=self.wire``: under compression the gradients travel at full
width, twice the 16-bit wire's bytes, and every value is still the mean."""
from __future__ import annotations

from minizero.comm import ReduceOp
from minizero.course.labs import given


class ZeRO1(given.ZeRO1):
    def post_backward(self) -> None:
        used = self.used_anywhere([s.param for group in self.groups for s in group.segments])
        for index, (group, buffer) in enumerate(zip(self.groups, self.full_grads.buffers, strict=True)):
            self.comm.reduce_scatter(group.shard_of(buffer), buffer, ReduceOp.AVG,
                                     tag=self.tag(f"group {index} gradients"))
            self.full_grads.take_averaged(index, used)
        self.full_grads.window_open = False

    def all_gather_parameters(self) -> None:
        for g, group in enumerate(self.groups):
            self.comm.all_gather(group.data, group.shard.detach().clone(), tag=self.tag(f"group {g} parameters"))
        self.remember_shared()

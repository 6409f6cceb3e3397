"""Writes the all-gather and calls the package's ``post_backward`` for the reduce-scatter and the gradients'
pieces: right values and bytes, ZeRO-1's first half not the learner's."""
from __future__ import annotations

from minizero.course.labs import given
from minizero.stages import ZeRO1 as Package


class ZeRO1(given.ZeRO1):
    def post_backward(self) -> None:
        Package.post_backward(self)

    def all_gather_parameters(self) -> None:
        for group in self.groups:
            mine = group.shard.clone()
            self.comm.all_gather(group.data, mine)
        self.remember_shared()

"""Every method handed to the package's ZeRO-2 by name: each step right, none of it the learner's."""
from __future__ import annotations

from minizero.course.labs import given
from minizero.stages import ZeRO2 as Package


class ZeRO2(given.ZeRO2):
    def post_accumulate_grad(self, param) -> None:
        Package.post_accumulate_grad(self, param)

    def deferred_reduce_scatter(self, index: int):
        return Package.deferred_reduce_scatter(self, index)

    def post_backward(self) -> None:
        Package.post_backward(self)

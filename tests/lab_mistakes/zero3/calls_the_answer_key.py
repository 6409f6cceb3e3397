"""Writes four of the unit's moments and calls the package's unit for the fifth (``super(given.Unit, self)``
reaches past the skeleton's blank to the finished method): a right step, one moment not the learner's."""
from __future__ import annotations

from minizero.course.labs import given


class Unit(given.Unit):
    def unshard(self, why: str) -> None:
        self.start_gather(why)
        if self._gathering is not None:
            for group, full in zip(self.groups, self._gathering.result(), strict=True):
                group.use(full)
            self._gathering = None

    def pre_forward(self) -> None:
        self.unshard("forward")

    def post_forward(self, reshard: bool) -> None:
        if reshard:
            self.reshard()

    def pre_backward(self) -> None:
        super(given.Unit, self).pre_backward()

    def post_backward(self, group) -> None:
        self._free(group)


class ZeRO3(given.ZeRO3):
    unit_class = Unit

"""After backward frees only the unit's first flat group ("the unit's parameters"): with two param groups a unit has
two, and the second stays gathered between steps -- full parameters held where only the shard should be."""
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
        self.unshard("backward")

    def post_backward(self, group) -> None:
        if group is self.groups[0]:
            self._free(group)


class ZeRO3(given.ZeRO3):
    unit_class = Unit

"""Keeps the first gathered buffers and reuses them in every later forward and backward: a stale copy after the step."""
from __future__ import annotations

from minizero.course.labs import given


class Unit(given.Unit):
    def unshard(self, why: str) -> None:
        kept = getattr(self, "_kept", None)
        if kept is None:
            self.start_gather(why)
            if self._gathering is None:
                return  # whole already
            kept = self._kept = self._gathering.result()
            self._gathering = None
        for group, full in zip(self.groups, kept, strict=True):
            group.use(full)

    def pre_forward(self) -> None:
        self.unshard("forward")

    def post_forward(self, reshard: bool) -> None:
        if reshard:
            self.reshard()

    def pre_backward(self) -> None:
        self.unshard("backward")

    def post_backward(self, group) -> None:
        self._free(group)


class ZeRO3(given.ZeRO3):
    unit_class = Unit

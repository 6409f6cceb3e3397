"""ZeRO-3's unit at run time: the moments it gathers and frees its parameters, named as FSDP2 names them.

A unit is the granularity of ZeRO-3 (FSDP's ``fully_shard``): its parameters are gathered just before it computes
and freed just after, so the full weights of only a unit or two exist at any time.  Which submodules are units, and
which parameters each holds, is decided once at wrap time (:mod:`minizero.parts.unit_plan`); the flat groups a unit
gathers and frees are :mod:`minizero.parts.unit_groups`.
"""
from __future__ import annotations

from typing import Callable

import torch

from ..comm import Work
from .unit_groups import ShardedFlatGroup


def replayed_by_backward() -> bool:
    """Is this forward a checkpointed block's replay (:mod:`minizero.parts.activations`), run by autograd's engine in a
    backward?  (``torch.utils.checkpoint`` tells its replays apart so too: the engine's graph task is set only then.)"""
    return torch._C._current_graph_task_id() != -1


class Unit:
    """One ZeRO-3 unit at run time -- FSDP2's ``FSDPParamGroup``: the flat groups of its parameters and
    the all-gather in flight for them, with a method for each moment it acts, named as FSDP2 names them.
    ``all_gather(unit, why)`` is the stage's: it starts the unit's all-gather on the communication thread and
    returns the work, whose result is one full buffer per group (:meth:`minizero.stages.ZeRO3.all_gather`).

    ``observe(event, nbytes, unit)`` hears every ``"gather"`` (a full buffer allocated -- counted from the
    moment the all-gather starts, so a prefetch takes memory while it runs) and every ``"free"``, with this
    unit's index: instrumentation outside the algorithm, like the byte ledger."""

    def __init__(self, index: int, name: str, groups: list[ShardedFlatGroup],
                 all_gather: Callable[["Unit", str], Work], observe: Callable[[str, int, int], None]):
        self.index, self.name, self.groups = index, name, groups
        self._all_gather, self._observe = all_gather, observe
        self._gathering = None  # the all-gather running on the communication thread, if any

    @property
    def label(self) -> str:
        return f"unit {self.index} ({self.name})"

    @property
    def gathered(self) -> bool:
        return all(g.gathered for g in self.groups)

    # ------------------------------------------------------------ the moments
    def pre_forward(self) -> None:
        self.unshard("forward")

    def post_forward(self, reshard: bool) -> None:
        if reshard:
            self.reshard()

    def pre_backward(self) -> None:
        """Autograd saved the parameters and views of their buffer (``weight.t()``): the gather refills that
        buffer's storage, freed in place at reshard, so both see the gathered values."""
        self.unshard("backward")

    def post_backward(self, group: ShardedFlatGroup) -> None:
        """``group``'s gradients are packed for their reduce-scatter: its full parameters can go."""
        self._free(group)

    # ------------------------------------------------------------ gathering and freeing
    def start_gather(self, why: str) -> None:
        """Start the all-gather on the communication thread (now, or as a prefetch)."""
        if self._gathering is not None or self.gathered:
            return
        self._gathering = self._all_gather(self, why)
        for g in self.groups:
            self._observe("gather", g.full_bytes, self.index)

    def unshard(self, why: str) -> None:
        """Full parameters, now: start the all-gather unless a prefetch did, and wait for it."""
        self.start_gather(why)
        if self._gathering is not None:
            for group, full in zip(self.groups, self._gathering.result(), strict=True):
                group.use(full)
            self._gathering = None

    def drop_prefetch(self) -> None:
        """A prefetch nobody used (the order came from the last forward): wait, then free it -- stale after a step."""
        if self._gathering is not None:
            self._gathering.wait()
            self._gathering = None
            for g in self.groups:
                self._observe("free", g.full_bytes, self.index)
                g.reshard()  # its buffer's memory: never pointed to, freed all the same

    def reshard(self) -> None:
        for group in self.groups:
            self._free(group)

    def _free(self, group: ShardedFlatGroup) -> None:
        if group.gathered:
            self._observe("free", group.full_bytes, self.index)
            group.reshard()

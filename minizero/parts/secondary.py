"""ZeRO++'s hierarchical partitioning (hpZ, Wang et al. 2023, section 3.2): a second copy of ZeRO-3's weights,
sharded within the node, so that the backward all-gather never leaves it.

ZeRO-3 gathers every unit twice a step from shards spread over all ``N`` ranks -- before its forward and
again before its backward -- and on a cluster both gathers cross the slow inter-node link.  hpZ keeps, when a
unit's forward gather completes, this rank's ``1/G`` slice of the full weights (``G`` ranks per node): the
node's ``G`` slices together are the whole unit, so the backward gather is an all-gather *inside the node*.
The price is memory -- up to ``Psi/G`` elements more per rank between forward and backward, where ZeRO-3 keeps
``Psi/N`` -- and the prize a third of the step's inter-node bytes (the forward gather and the reduce-scatter
still cross).  The values are the forward's own (exact copies; hpZ with quantized weights is not built),
so the backward computes with what the forward computed with, as in ZeRO-3.

A secondary slice is used once: consumed by the backward gather, or dropped at the optimizer step -- after it
the weights have changed.
"""
from __future__ import annotations

from typing import Callable

import torch

from ..comm import Comm


class SecondaryShards:
    """This rank's node-local slices of the units gathered for forward, and the all-gather that rebuilds a
    unit from them.  ``observe(event, nbytes, unit)`` hears each slice kept (``"gather"``) and dropped (``"free"``),
    so the gathered working set counts them (:class:`minizero.observe.memory.GatheredMemory`)."""

    def __init__(self, comm: Comm, observe: Callable[[str, int, int], None]):
        self.nodes = comm.nodes_or_assumed("hpz")
        self.node = comm.over(self.nodes.node_ranks(comm.rank))
        self._observe = observe
        self._slices: dict[int, tuple[torch.Tensor, int]] = {}  # id(group) -> (slice, unit)

    def reserve(self, group, full: torch.Tensor, unit: int) -> None:
        """When a forward gather is started (on the main thread, where its full buffer is allocated): room for this
        rank's ``1/G`` of it, replacing an older slice -- counted from now, as the full buffer is.  Counted when the
        gather completes instead, on the communication thread, a prefetched unit's slice came before or after the
        main thread freed the unit before it, and the peak with it (issue 46)."""
        self.drop(group)
        mine = full.new_empty(full.numel() // self.node.world_size)
        self._slices[id(group)] = (mine, unit)
        self._observe("gather", mine.numel() * mine.element_size(), unit)

    def keep(self, group, full: torch.Tensor) -> None:
        """After the forward gather (on the communication thread): the slice reserved for it takes its values."""
        mine, _ = self._slices[id(group)]
        mine.copy_(full[self.node.rank * mine.numel():(self.node.rank + 1) * mine.numel()])

    def holds(self, group) -> bool:
        return id(group) in self._slices

    def all_gather(self, full: torch.Tensor, group, tag) -> None:
        """The backward gather: the node's slices into ``full``, inside the node; the slice is used up."""
        mine, _ = self._slices[id(group)]
        self.node.all_gather(full, mine, tag=tag)
        self.drop(group)

    def drop(self, group=None) -> None:
        """Forget ``group``'s slice, or every slice (the optimizer step changes the weights they copy)."""
        for key in [id(group)] if group is not None else list(self._slices):
            if key in self._slices:
                mine, unit = self._slices.pop(key)
                self._observe("free", mine.numel() * mine.element_size(), unit)

    def held(self) -> list[torch.Tensor]:
        return [mine for mine, _ in self._slices.values()]

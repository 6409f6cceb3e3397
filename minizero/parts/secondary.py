"""ZeRO++'s hierarchical partitioning (hpZ, Wang et al. 2023, section 3.2): a second copy of ZeRO-3's weights,
sharded within the node, so that the backward all-gather never leaves it.

ZeRO-3 gathers every unit twice a step from shards spread over all ``N`` ranks -- before its forward and
again before its backward -- and on a cluster both gathers cross the slow inter-node link.  hpZ keeps, from a
unit's forward gather, this rank's ``1/G`` slice of the full weights (``G`` ranks per node): the
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
        self._slices: dict[int, list] = {}  # id(group) -> [slice (None until its gather ends), unit, bytes]

    def reserve(self, group, full: torch.Tensor, unit: int) -> None:
        """When a forward gather is started (on the main thread, where its full buffer is counted): this rank's
        ``1/G`` of it, counted from now, replacing an older slice.  Counted when the gather ended instead, on the
        communication thread, a prefetched unit's slice came before or after the main thread freed the unit before
        it, and the peak with it (issue 46).  The slice itself is made by :meth:`keep`, on the communication thread:
        on a GPU its memory is then the communication stream's, which the backward gather reading it runs on."""
        self.drop(group)
        self._slices[id(group)] = [None, unit, full.numel() // self.node.world_size * full.element_size()]
        self._observe("gather", self._slices[id(group)][2], unit)

    def keep(self, group, full: torch.Tensor) -> None:
        """After the forward gather (on the communication thread): the slice reserved for it, a copy of its part."""
        size = full.numel() // self.node.world_size
        self._slices[id(group)][0] = full[self.node.rank * size:(self.node.rank + 1) * size].clone()

    def holds(self, group) -> bool:
        """Is ``group``'s slice there, with its values (a forward gather that failed left none)?"""
        return self._slices.get(id(group), [None])[0] is not None

    def all_gather(self, full: torch.Tensor, group, tag) -> None:
        """The backward gather: the node's slices into ``full``, inside the node; the slice is used up."""
        self.node.all_gather(full, self._slices[id(group)][0], tag=tag)
        self.drop(group)

    def drop(self, group=None) -> None:
        """Forget ``group``'s slice, or every slice (the optimizer step changes the weights they copy)."""
        for key in [id(group)] if group is not None else list(self._slices):
            if key in self._slices:
                _, unit, nbytes = self._slices.pop(key)
                self._observe("free", nbytes, unit)

    def held(self) -> list[torch.Tensor]:
        return [mine for mine, _, _ in self._slices.values() if mine is not None]

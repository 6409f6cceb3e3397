"""Collectives that cross the slow link as little as they can: two rings, one inside each node and one
across the nodes (Horovod's hierarchical all-reduce; what NCCL's trees and rings over the topology do).

A flat ring of ``N = M x G`` ranks on ``M`` nodes of ``G`` takes ``2(N-1)`` steps, and every step waits for
its slowest hop -- a node's last rank sending to the next node's first.  So a flat all-reduce pays the slow
link's latency ``2(N-1)`` times and pushes ``2(N-1)/N`` of the tensor through each node's link.  Split it:

1. **reduce-scatter inside the node** (``G-1`` fast steps): local rank ``j`` holds the node's sum of
   chunk ``j``, ``1/G`` of the tensor;
2. **all-reduce across the nodes** of that chunk, in the ring of the ``M`` ranks at place ``j`` on every
   node (``2(M-1)`` slow steps; the ``G`` rings run at once, sharing each node's link);
3. **all-gather inside the node** (``G-1`` fast steps).

Slow steps: ``2(M-1)`` instead of ``2(N-1)``.  Bytes through a node's link: ``G`` rings x ``2(M-1)/M`` of
``S/G`` = ``2(M-1)/M x S``, against the flat ring's ``2(N-1)/N x S`` -- at two nodes ``S`` instead of
nearly ``2S``.  Every rank sends
``2(G-1)/G x S`` inside its node and ``2(M-1)/(M G) x S`` across (:func:`link_bytes_sent`, below).

Reduce-scatter and all-gather split the same way: rank ``(node k, place j)`` owns world chunk ``k G + j``,
so inside the node place ``j`` collects the *column* of chunks ``{k' G + j}`` and the ring across the nodes
hands node ``k`` its own.  The sums add the same numbers in another order: bit for bit the flat ring's on
data whose sums are exact (dyadic), to rounding otherwise.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from .collective import ReduceOp, chunk_bounds
from .ring import RingComm


class HierarchicalComm(RingComm):
    """The ring backend on a cluster of nodes, its all-reduce, reduce-scatter and all-gather in two levels;
    the other collectives (broadcast, push, pull, all-to-all) as the flat ring's.  Its two views, :attr:`node`
    and :attr:`across`, are flat rings of their own (:meth:`~minizero.comm.base.Comm.over`)."""

    name = "hierarchical"

    def __init__(self, group: dist.ProcessGroup | None = None, check: bool = False, network=None):
        super().__init__(group, check, network)
        if self.nodes is None:
            raise ValueError(f"rank {self.rank}: the hierarchical backend needs to know where the ranks sit: give a "
                             f"network with nodes, e.g. network='nodes=2x2' (placement only) or "
                             f"'nodes=2x2,intra=nvlink,inter=ethernet-100g'")
        self.node = self.over(self.nodes.node_ranks(self.rank))
        self.across = self.over(self.nodes.across_ranks(self.rank))

    @property
    def _flat(self) -> bool:
        """A view (a node, the ranks across nodes, HSDP's mesh) runs the flat ring's algorithms."""
        return self._root is not self

    def _all_reduce(self, tensor: torch.Tensor, op: ReduceOp) -> None:
        if self._flat:
            return super()._all_reduce(tensor, op)
        node, across = self.node, self.across
        flat = tensor.view(-1)
        columns = [flat[a:b] for a, b in chunk_bounds(flat.numel(), node.world_size)]
        mine = columns[node.rank]
        node._ring_reduce_scatter(columns, mine, op)  # 1. the node's sum of my column
        pieces = across._chunks(mine)
        across._ring_reduce_scatter(pieces, pieces[across.rank], op)  # 2. ... over every node: a ring all-reduce
        if op is ReduceOp.AVG:
            pieces[across.rank].div_(self.world_size)  # on 1/N of the data, once, as the flat ring divides
        across._ring_all_gather(pieces)
        node._ring_all_gather(columns)  # 3. every column, to every rank of the node

    def _reduce_scatter(self, output: torch.Tensor, input: torch.Tensor, op: ReduceOp) -> None:
        if self._flat:
            return super()._reduce_scatter(output, input, op)
        node, across = self.node, self.across
        chunk = output.numel()
        # World chunk k G + j belongs to (node k, place j): place j's column holds chunks j, G + j, 2G + j, ...
        # (a copy always: the input is only read, and with one node the transpose is already contiguous)
        columns = input.view(across.world_size, node.world_size, chunk).transpose(0, 1).clone(
            memory_format=torch.contiguous_format)
        columns = [c.view(-1) for c in columns]
        mine = columns[node.rank]
        node._ring_reduce_scatter(columns, mine, op)  # the node's sum of my column (M chunks)
        across._ring_reduce_scatter(list(mine.view(across.world_size, chunk)), output.view(-1), op)
        if op is ReduceOp.AVG:
            output.div_(self.world_size)

    def _all_gather(self, output: torch.Tensor, input: torch.Tensor) -> None:
        if self._flat:
            return super()._all_gather(output, input)
        node, across = self.node, self.across
        chunk = input.numel()
        columns = output.new_empty(node.world_size, across.world_size, chunk)
        mine = columns[node.rank]
        mine[across.rank].copy_(input.view(-1))
        across._ring_all_gather(list(mine))  # my column from every node, over the slow link once
        node._ring_all_gather([c.view(-1) for c in columns])  # the columns, inside the node
        output.view(across.world_size, node.world_size, chunk).copy_(columns.transpose(0, 1))


def link_bytes_sent(kind: str, numel: int, element_size: int, nodes, rank: int, hierarchical: bool) -> dict[str, int]:
    """Bytes rank ``rank`` sends per link class (``{"intra": ..., "inter": ...}``) in the ``kind`` collective of a
    full tensor of ``numel`` elements, on a flat ring over ``nodes`` or in two levels -- what the ledger must
    count, from the ring's own message sizes (:func:`~minizero.comm.native.ring_messages`)."""
    from .native import ring_messages  # (native imports the ring, which this module extends)
    from .nodes import INTER, INTRA
    n, g, m = nodes.world_size, nodes.per_node, nodes.count
    sent = {INTRA: 0, INTER: 0}
    if not hierarchical or kind not in ("all_reduce", "reduce_scatter", "all_gather"):
        # a flat ring sends everything to the right neighbour: across at a node's last rank (with M > 1)
        sent[nodes.link(rank, (rank + 1) % n)] += sum(ring_messages(kind, numel, element_size, n, rank))
        return sent
    place, node = rank % g, nodes.node_of(rank)
    if kind == "all_reduce":
        column = [b - a for a, b in chunk_bounds(numel, g)][place]
        sent[INTRA] = sum(ring_messages("all_reduce", numel, element_size, g, place))
        sent[INTER] = sum(ring_messages("all_reduce", column, element_size, m, node))
    else:  # the node's phase on M columns' worth, the across phase on one column of M chunks
        sent[INTRA] = sum(ring_messages(kind, numel, element_size, g, place))
        sent[INTER] = sum(ring_messages(kind, numel // g, element_size, m, node))
    return sent

"""Lab ``hierarchical`` in another style: the mean divided once, on the whole tensor after both gathers (each element
divided by N once either way: the same values), and the phases written as two helpers."""
from __future__ import annotations

from minizero.comm import ReduceOp, chunk_bounds
from minizero.course.labs.skeletons.contract.hierarchical import Hierarchical as Skeleton


class Hierarchical(Skeleton):
    def _all_reduce(self, tensor, op) -> None:
        flat = tensor.view(-1)
        columns = [flat[a:b] for a, b in chunk_bounds(flat.numel(), self.node.world_size)]
        self._across_the_nodes(columns, op)
        if op is ReduceOp.AVG:
            flat.div_(self.world_size)

    def _across_the_nodes(self, columns, op) -> None:
        column = columns[self.node.rank]
        self.node._ring_reduce_scatter(columns, column, op)
        pieces = self.across._chunks(column)
        self.across._ring_reduce_scatter(pieces, pieces[self.across.rank], op)
        self.across._ring_all_gather(pieces)
        self.node._ring_all_gather(columns)

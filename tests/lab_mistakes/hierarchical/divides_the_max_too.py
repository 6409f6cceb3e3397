"""Divides by N whatever the op -- the mean's division, done for MAX as well: SUM and AVG are right, every max is
N times too small (once diagnosed as "a max added"; issue 45)."""
from __future__ import annotations

from minizero.comm import ReduceOp, chunk_bounds
from minizero.course.labs.skeletons.contract.hierarchical import Hierarchical as Skeleton


class Hierarchical(Skeleton):
    def _all_reduce(self, tensor, op) -> None:
        flat = tensor.view(-1)
        columns = [flat[a:b] for a, b in chunk_bounds(flat.numel(), self.node.world_size)]
        column = columns[self.node.rank]
        self.node._ring_reduce_scatter(columns, column, op)
        pieces = self.across._chunks(column)
        piece = pieces[self.across.rank]
        self.across._ring_reduce_scatter(pieces, piece, op)
        if op is not ReduceOp.SUM:  # "AVG and MAX are not sums: divide"
            piece.div_(self.world_size)
        self.across._ring_all_gather(pieces)
        self.node._ring_all_gather(columns)

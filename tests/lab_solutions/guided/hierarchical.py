"""Lab ``hierarchical`` filled in from the guided skeleton's docstrings alone (``tests/test_labs.py`` checks it
passes)."""
from __future__ import annotations

from minizero.comm import ReduceOp
from minizero.course.labs.skeletons.guided.hierarchical import Hierarchical as Skeleton


class Hierarchical(Skeleton):
    def _all_reduce(self, tensor, op) -> None:
        columns = self.node._chunks(tensor)
        mine = columns[self.node.rank]
        self.node._ring_reduce_scatter(columns, mine, op)
        self.across.all_reduce(mine, ReduceOp.SUM if op is ReduceOp.AVG else op)
        if op is ReduceOp.AVG:
            mine.div_(self.world_size)
        self.node._ring_all_gather(columns)

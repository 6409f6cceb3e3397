"""The hierarchical lab's base, and its known mistakes: two-level all-reduces with one classic slip each.

**The base** (:data:`Hierarchical`) is the package's :class:`~minizero.comm.hierarchical.HierarchicalComm` with
``_all_reduce`` taken out (:func:`minizero.course.labs.given.without`: it raises, naming itself) -- and with its two
views, ``node`` and ``across``, flat rings whatever the learner's class does.  A view is a copy of the whole Comm
(:meth:`~minizero.comm.base.Comm.over`), so its ``all_reduce`` would be the learner's ``_all_reduce`` again: the
package's guards it with ``_flat``, which a learner's file need not know of -- and which would lead, through
``super()``, to the base's raising method.  Here each view's ``_all_reduce`` is the ring's, so calling
``self.across.all_reduce(...)`` inside yours is the flat ring over those ranks, as the lesson says.
(It lives in :mod:`minizero.course.labs.given`, beside the other labs' bases.)

**The mistakes** subclass the base; ``mistake`` says, in the second person, what the learner did.  Five give the
wrong values on some node shape (a division by the wrong number or one too many, a phase skipped, phases in the
wrong order); two give the right values over the wrong links -- what only the bytes per link class show.  The checker runs a failing
case through each (:mod:`minizero.course.labs.properties_hierarchical`) and names the one whose values and bytes per
link are exactly the learner's.
"""
from __future__ import annotations

from ...comm import ReduceOp, RingComm
from .given import Hierarchical


def _summed(op: ReduceOp) -> ReduceOp:
    """The op the across ring runs: a mean is a sum there, divided once by N afterwards."""
    return ReduceOp.SUM if op is ReduceOp.AVG else op


class DividesByNodeSize(Hierarchical):
    mistake = ("you divided the mean by G, the ranks of a node (self.node.world_size), not by N = M x G: the "
               "across phase summed M nodes' partial sums, so the result is M times the mean")
    name = "hierarchical-divides-by-g"

    def _all_reduce(self, tensor, op) -> None:
        columns = self.node._chunks(tensor)
        mine = columns[self.node.rank]
        self.node._ring_reduce_scatter(columns, mine, op)
        self.across.all_reduce(mine, _summed(op))
        if op is ReduceOp.AVG:
            mine.div_(self.node.world_size)
        self.node._ring_all_gather(columns)


class SkipsTheAcrossPhase(Hierarchical):
    mistake = ("you skipped the across phase: a reduce-scatter and an all-gather inside the node make each node's "
               "own all-reduce -- every rank ends with its node's sum, the other nodes' tensors never in it")
    name = "hierarchical-no-across"

    def _all_reduce(self, tensor, op) -> None:
        columns = self.node._chunks(tensor)
        mine = columns[self.node.rank]
        self.node._ring_reduce_scatter(columns, mine, op)
        if op is ReduceOp.AVG:
            mine.div_(self.world_size)
        self.node._ring_all_gather(columns)


class FlatRingAllReduce(Hierarchical):
    mistake = ("you ran one flat ring over all N ranks: the right values, but the ring crosses between nodes at "
               "every node's last rank on each of its 2(N-1) steps -- the flat ring's bytes over the slow link, "
               "not the two-level all-reduce's 2(M-1)/M of a 1/G column")
    name = "hierarchical-flat"

    def _all_reduce(self, tensor, op) -> None:
        RingComm._all_reduce(self, tensor, op)


class GathersBeforeAcross(Hierarchical):
    mistake = ("you all-gathered inside the node before the across phase: the other nodes' sums reached only your "
               "own column, and every other column kept its node's sum -- gather last, after the across phase")
    name = "hierarchical-gathers-first"

    def _all_reduce(self, tensor, op) -> None:
        columns = self.node._chunks(tensor)
        mine = columns[self.node.rank]
        self.node._ring_reduce_scatter(columns, mine, op)
        self.node._ring_all_gather(columns)
        self.across.all_reduce(mine, _summed(op))
        if op is ReduceOp.AVG:
            mine.div_(self.world_size)


class DividesAtBothLevels(Hierarchical):
    mistake = ("you divided by N at both levels, after the node's reduce-scatter and again after the across phase: "
               "1/N of the mean -- divide once, by N, after the across phase")
    name = "hierarchical-divides-twice"

    def _all_reduce(self, tensor, op) -> None:
        columns = self.node._chunks(tensor)
        mine = columns[self.node.rank]
        self.node._ring_reduce_scatter(columns, mine, op)
        if op is ReduceOp.AVG:
            mine.div_(self.world_size)
        self.across.all_reduce(mine, _summed(op))
        if op is ReduceOp.AVG:
            mine.div_(self.world_size)
        self.node._ring_all_gather(columns)


class AveragesAcrossToo(Hierarchical):
    mistake = ("you passed AVG on to the across all-reduce, whose ring divides by its own M ranks, and divided by N "
               "as well: 1/M of the mean -- reduce with SUM across the nodes and divide once, by N")
    name = "hierarchical-averages-across"

    def _all_reduce(self, tensor, op) -> None:
        columns = self.node._chunks(tensor)
        mine = columns[self.node.rank]
        self.node._ring_reduce_scatter(columns, mine, op)
        self.across.all_reduce(mine, op)
        if op is ReduceOp.AVG:
            mine.div_(self.world_size)
        self.node._ring_all_gather(columns)


class AcrossTheWholeTensor(Hierarchical):
    mistake = ("you all-reduced the whole tensor across the nodes (after the node's own all-reduce): the right "
               "values, but each of a node's G ranks sends the whole tensor through the node's link, G times what "
               "the across phase must carry -- only your 1/G column crosses")
    name = "hierarchical-whole-across"

    def _all_reduce(self, tensor, op) -> None:
        columns = self.node._chunks(tensor)
        self.node._ring_reduce_scatter(columns, columns[self.node.rank], op)
        self.node._ring_all_gather(columns)
        self.across.all_reduce(tensor, _summed(op))
        if op is ReduceOp.AVG:
            tensor.div_(self.world_size)


HIERARCHICAL_MISTAKES = (DividesByNodeSize, SkipsTheAcrossPhase, FlatRingAllReduce, GathersBeforeAcross,
                         DividesAtBothLevels, AveragesAcrossToo, AcrossTheWholeTensor)

"""Known mistakes of the tree lab: all-reduces that give the right sums over the wrong shape of messages.

A tree's values are easy; its shape is the lesson.  Each class here is a
communication layer with one classic wrong shape, and ``mistake`` says, in the
second person, what the learner did.  The checker runs the failing case
through each (:mod:`minizero.course.labs.properties_tree`) and names the one whose
rounds and bytes are exactly the learner's.
"""
from __future__ import annotations

from ...comm.tree import TreeComm


class ChainAllReduce(TreeComm):
    """Rank by rank: N-1 hops up to rank 0, N-1 hops back down.  Each rank sends at most twice the tensor, as in
    the tree, but the messages stand one after another: 2(N-1) rounds, the ring's latency without its bandwidth."""

    mistake = ("you passed the tensor along a chain, rank to rank (N-1 hops up, N-1 down): the right sums and a tree's "
               "bytes per rank, but 2(N-1) rounds one after another -- the ring's latency, not the tree's 2 ceil(log2 N)")
    name = "tree-chain"

    def _tree_reduce(self, tensor, op) -> None:
        n, r = self.world_size, self.rank
        if r + 1 < n:
            incoming = tensor.new_empty(tensor.numel())
            self._recv(incoming, r + 1)
            op.combine(tensor, incoming, out=tensor)
        if r > 0:
            self._send(tensor, r - 1)

    def _tree_broadcast(self, tensor) -> None:
        n, r = self.world_size, self.rank
        if r > 0:
            self._recv(tensor, r - 1)
        if r + 1 < n:
            self._send(tensor, r + 1)


class StarAllReduce(TreeComm):
    """Every rank sends to rank 0, rank 0 sends the result to every rank: the root all-reduce of lesson 1, whose root
    takes N-1 messages in and sends N-1 out, one at a time."""

    mistake = ("you made a star, not a tree: every rank sent to rank 0 and rank 0 sent the result to every rank -- "
               "the root all-reduce, whose root sends (N-1) tensors in 2(N-1) rounds")
    name = "tree-star"

    def _tree_reduce(self, tensor, op) -> None:
        if self.rank:
            self._send(tensor, 0)
            return
        incoming = tensor.new_empty(tensor.numel())
        for src in range(1, self.world_size):
            self._recv(incoming, src)
            op.combine(tensor, incoming, out=tensor)

    def _tree_broadcast(self, tensor) -> None:
        if self.rank:
            self._recv(tensor, 0)
            return
        for dst in range(1, self.world_size):
            self._send(tensor, dst)


TREE_MISTAKES = (ChainAllReduce, StarAllReduce)

"""Lab ``tree`` written from the contract skeleton alone: the binomial tree's parent and children as it defines
them (``tests/test_lab_tree.py`` checks it passes)."""
from __future__ import annotations

from minizero.course.labs.skeletons.contract.tree import Tree as Skeleton


def lowbit(r: int) -> int:
    return r & -r


class Tree(Skeleton):
    def children(self) -> list[int]:
        """r + 2^j for each 2^j below lowbit(r) (every 2^j < N for rank 0), below N; farthest first."""
        r, n = self.rank, self.world_size
        powers = []
        j = 1
        while j < n and (r == 0 or j < lowbit(r)):
            powers.append(j)
            j *= 2
        return [r + p for p in reversed(powers) if r + p < n]

    def _tree_reduce(self, tensor, op) -> None:
        incoming = tensor.new_empty(tensor.numel())
        for child in reversed(self.children()):  # nearest first: the nearest child's subtree finishes first
            self._recv(incoming, child)
            op.combine(tensor, incoming, out=tensor)
        if self.rank:
            self._send(tensor, self.rank - lowbit(self.rank))

    def _tree_broadcast(self, tensor) -> None:
        if self.rank:
            self._recv(tensor, self.rank - lowbit(self.rank))
        for child in self.children():
            self._send(tensor, child)

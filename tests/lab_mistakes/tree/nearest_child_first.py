"""The broadcast sends to its children nearest first (r+1, r+2, r+4...): the farthest child, heading the deepest
subtree, starts forwarding a round late."""
from __future__ import annotations

import torch

from minizero.course.labs import given


class Tree(given.Tree):
    def _tree_reduce(self, tensor, op) -> None:
        n, r = self.world_size, self.rank
        incoming = torch.empty_like(tensor)
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
        while bit < n and not r & bit:
            bit *= 2
        if r:
            self._recv(tensor, r - bit)
        child = 1
        while child < bit:
            if r + child < n:
                self._send(tensor, r + child)
            child *= 2

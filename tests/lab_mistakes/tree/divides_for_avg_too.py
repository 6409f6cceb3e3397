"""The reduce divides by N itself when the op is AVG -- and the given all_reduce divides again."""
from __future__ import annotations

import torch

from minizero.comm import ReduceOp
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
        if op is ReduceOp.AVG:
            tensor.div_(n)

    def _tree_broadcast(self, tensor) -> None:
        n, r = self.world_size, self.rank
        bit = 1
        while bit < n and not r & bit:
            bit *= 2
        if r:
            self._recv(tensor, r - bit)
        bit //= 2
        while bit:
            if r + bit < n:
                self._send(tensor, r + bit)
            bit //= 2


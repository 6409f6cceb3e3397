"""Combines what arrives with ``.float()`` on both sides -- a habit from code that averages integer counts: every
all-reduce of small integers is exact in float32 whatever its dtype, so each result is right; a float64 gradient
reduced over this tree keeps float32's 24 bits, and training drifts from single-device training."""
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
                op.combine(tensor.float(), incoming.float(), out=tensor)
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

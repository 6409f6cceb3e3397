"""Both phases run int(log2 N) rounds -- floor, not ceil: at N = 3 the last rank is never reached."""
from __future__ import annotations

import math

import torch

from minizero.course.labs import given


class Tree(given.Tree):
    def _tree_reduce(self, tensor, op) -> None:
        n, r = self.world_size, self.rank
        incoming = torch.empty_like(tensor)
        rounds = int(math.log2(n))
        for k in range(rounds):
            bit = 1 << k
            if r & bit:
                self._send(tensor, r - bit)
                return
            if r + bit < n:
                self._recv(incoming, r + bit)
                op.combine(tensor, incoming, out=tensor)

    def _tree_broadcast(self, tensor) -> None:
        n, r = self.world_size, self.rank
        rounds = int(math.log2(n))
        k = 0
        while k < rounds and not r & (1 << k):
            k += 1
        if r:
            if k == rounds:
                return  # (its parent is beyond the rounds: nothing comes)
            self._recv(tensor, r - (1 << k))
        for j in reversed(range(k)):
            if r + (1 << j) < n:
                self._send(tensor, r + (1 << j))

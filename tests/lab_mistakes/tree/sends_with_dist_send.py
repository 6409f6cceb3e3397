"""The phases call ``torch.distributed.send``/``recv`` directly instead of the comm's ``_send``/``_recv``: right values,
but the ledger never hears of a message."""
from __future__ import annotations

import torch
import torch.distributed as dist

from minizero.course.labs import given


class Tree(given.Tree):
    def _tree_reduce(self, tensor, op) -> None:
        n, r = self.world_size, self.rank
        incoming = torch.empty_like(tensor)
        bit = 1
        while bit < n:
            if r & bit:
                dist.send(tensor, r - bit)
                return
            if r + bit < n:
                dist.recv(incoming, r + bit)
                op.combine(tensor, incoming, out=tensor)
            bit *= 2

    def _tree_broadcast(self, tensor) -> None:
        n, r = self.world_size, self.rank
        bit = 1
        while bit < n and not r & bit:
            bit *= 2
        if r:
            dist.recv(tensor, r - bit)
        bit //= 2
        while bit:
            if r + bit < n:
                dist.send(tensor, r + bit)
            bit //= 2

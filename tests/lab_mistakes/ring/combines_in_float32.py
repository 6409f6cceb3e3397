"""Combines what arrives with ``.float()`` on both sides -- a habit from code that averages integer counts: every
collective on small integers is exact in float32 whatever its dtype, so each result is right; a float64 gradient
reduced over this ring keeps float32's 24 bits, and training drifts from single-device training."""
from __future__ import annotations

import torch

from minizero.course.labs import given


class Ring(given.Ring):
    def _ring_reduce_scatter(self, chunks, out, op) -> None:
        n, r = self.world_size, self.rank
        if n == 1:
            if out is not chunks[r]:
                out.copy_(chunks[r])
            return
        send = chunks[(r - 1) % n].clone()
        for step in range(n - 1):
            index = (r - step - 2) % n
            incoming = torch.empty_like(chunks[index])
            self._send_right_recv_left(send, incoming, "reduce-scatter", step)
            if index == r:
                op.combine(incoming.float(), chunks[index].float(), out=out)
            else:
                send = op.combine(incoming.float(), chunks[index].float(), out=incoming)

    def _ring_all_gather(self, chunks) -> None:
        n, r = self.world_size, self.rank
        for step in range(n - 1):
            self._send_right_recv_left(chunks[(r - step) % n], chunks[(r - step - 1) % n], "all-gather", step)

"""Reduce-scatter sends its own raw chunk at every step instead of the partial sum it combined the step before."""
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
        for step in range(n - 1):
            send = chunks[(r - step - 1) % n]  # the raw chunk: what arrived last step is dropped
            index = (r - step - 2) % n
            incoming = torch.empty_like(chunks[index])
            self._send_right_recv_left(send, incoming, "reduce-scatter", step)
            if index == r:
                op.combine(incoming, chunks[index], out=out)

    def _ring_all_gather(self, chunks) -> None:
        n, r = self.world_size, self.rank
        for step in range(n - 1):
            self._send_right_recv_left(chunks[(r - step) % n], chunks[(r - step - 1) % n], "all-gather", step)

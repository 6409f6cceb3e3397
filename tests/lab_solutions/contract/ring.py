"""Lab ``ring`` written from the contract skeleton alone (``tests/test_labs.py`` checks it passes)."""
from __future__ import annotations

import torch

from minizero.course.labs.skeletons.contract.ring import Ring as Contract


class Ring(Contract):
    def _ring_reduce_scatter(self, chunks, out, op) -> None:
        n, r = self.world_size, self.rank
        # Chunk c starts on rank c+1 and travels right, each rank adding its own part, so it ends on rank c.
        # At step s rank r therefore holds the partial of chunk (r - 1 - s) and receives that of (r - 2 - s).
        partial = chunks[(r - 1) % n].clone()
        for step in range(n - 1):
            c = (r - 2 - step) % n
            arrived = torch.empty_like(chunks[c])
            self._send_right_recv_left(partial, arrived, "reduce-scatter", step)
            partial = op.combine(arrived, chunks[c], out=arrived)
        # After N-1 steps the last chunk to arrive was chunk r (with N = 1: no step, and partial is chunk r).
        out.copy_(partial)

    def _ring_all_gather(self, chunks) -> None:
        n, r = self.world_size, self.rank
        for step in range(n - 1):
            self._send_right_recv_left(chunks[(r - step) % n], chunks[(r - 1 - step) % n], "all-gather", step)

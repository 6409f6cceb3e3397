"""Lab ``ring`` in another style: its own labels for the ring steps ("rs", "ag"), a stall's report words only.
The board took only its own names once, and a correct ring failed with ``tuple.index(x)`` (issue 45)."""
from __future__ import annotations

import torch

from minizero.course.labs.skeletons.contract.ring import Ring as Contract


class Ring(Contract):
    def _ring_reduce_scatter(self, chunks, out, op) -> None:
        n, r = self.world_size, self.rank
        partial = chunks[(r - 1) % n].clone()
        for step in range(n - 1):
            c = (r - 2 - step) % n
            arrived = torch.empty_like(chunks[c])
            self._send_right_recv_left(partial, arrived, "rs", step)
            partial = op.combine(arrived, chunks[c], out=arrived)
        out.copy_(partial)

    def _ring_all_gather(self, chunks) -> None:
        n, r = self.world_size, self.rank
        for step in range(n - 1):
            self._send_right_recv_left(chunks[(r - step) % n], chunks[(r - 1 - step) % n], "ag", step)

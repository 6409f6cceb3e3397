"""Lab ``tree`` as MPI's binomial algorithms write it: a loop over bit masks, no parent or children computed -- a
rank with bit k set sends up at round k and is done; one with it clear receives from rank + 2^k if there is one.
The broadcast walks the masks back down.  Children are received in the opposite order to the answer key's, which
changes no exact sum and no round."""
from __future__ import annotations

import torch

from minizero.course.labs.skeletons.contract.tree import Tree as Contract


class Tree(Contract):
    def _tree_reduce(self, tensor: torch.Tensor, op) -> None:
        mask = 1
        while mask < self.world_size:
            if self.rank & mask:
                self._send(tensor, self.rank - mask)
                return
            if self.rank + mask < self.world_size:
                incoming = torch.empty_like(tensor)
                self._recv(incoming, self.rank + mask)
                op.combine(tensor, incoming, out=tensor)
            mask <<= 1

    def _tree_broadcast(self, tensor: torch.Tensor) -> None:
        mask = 1
        while mask < self.world_size:
            mask <<= 1
        while mask > 1:
            mask >>= 1
            if self.rank % (2 * mask) == 0 and self.rank + mask < self.world_size:
                self._send(tensor, self.rank + mask)
            elif self.rank % (2 * mask) == mask:
                self._recv(tensor, self.rank - mask)

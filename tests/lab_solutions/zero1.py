"""Lab ``zero1`` filled in from the skeleton's docstrings alone (``tests/test_labs.py`` checks it passes)."""
from __future__ import annotations

from minizero.compress import reduce_scatter_mean
from minizero.labs.skeletons.zero1 import ZeRO1 as Skeleton


class ZeRO1(Skeleton):
    def reduce_scatter_gradients(self, used: set[int]) -> None:
        for index, (group, buffer) in enumerate(zip(self.groups, self.grad_buffers)):
            owned = group.shard_of(buffer)
            reduce_scatter_mean(self.comm, self.wire, buffer, owned, index, [s.name for s in group.segments],
                                self.tag(f"group {index} gradients"))
            buffer[:group.rank * group.shard_size].zero_()
            buffer[(group.rank + 1) * group.shard_size:].zero_()
            for piece in group.pieces:
                if id(piece.segment.param) in used:
                    piece.param.grad = owned[piece.offset:piece.offset + piece.stop - piece.start]

    def all_gather_parameters(self) -> None:
        for g, group in enumerate(self.groups):
            self.comm.all_gather(group.data, group.shard.detach().clone(), tag=self.tag(f"group {g} parameters"))

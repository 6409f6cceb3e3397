"""Lab ``zero1`` in another style: the owned shard as ``buffer.chunk(N)[rank]``, the used-flags agreed by a SUM
(anything above zero: used somewhere) as integers, and the other ranks' chunks zeroed one by one."""
from __future__ import annotations

import torch

from minizero.comm import ReduceOp
from minizero.course.labs.skeletons.contract.zero1 import ZeRO1 as Contract


class ZeRO1(Contract):
    def post_backward(self) -> None:
        params = [s.param for group in self.groups for s in group.segments]
        counts = torch.tensor([1 if id(p) in self._used else 0 for p in params], dtype=torch.int64)
        self._used.clear()
        if self.find_unused_parameters:
            self.comm.all_reduce(counts, ReduceOp.SUM)
        used_somewhere = {id(p) for p, c in zip(params, counts.tolist(), strict=True) if c > 0}
        for g, (group, buffer) in enumerate(zip(self.groups, self.full_grads.buffers, strict=True)):
            chunks = buffer.chunk(self.world_size)
            owned = chunks[self.rank]
            self.comm.reduce_scatter(owned, buffer, ReduceOp.AVG, wire=self.wire, key=g)
            for i, chunk in enumerate(chunks):
                if i != self.rank:
                    chunk.zero_()
            for piece in group.pieces:
                mean = owned.narrow(0, piece.offset, piece.stop - piece.start)
                before = piece.param.grad
                if before is not None and before.data_ptr() != mean.data_ptr():
                    piece.param.grad = mean.add_(before)  # accumulated outside the window: added, not replaced
                elif id(piece.segment.param) in used_somewhere:
                    piece.param.grad = mean
        self.full_grads.window_open = False

    def all_gather_parameters(self) -> None:
        for group in self.groups:
            self.comm.all_gather(group.data, group.shard.detach().clone())
        self.remember_shared()

"""Lab ``zero1`` written from the contract skeleton alone (``tests/test_labs.py`` checks it passes)."""
from __future__ import annotations

import torch

from minizero.comm import ReduceOp
from minizero.course.labs.skeletons.contract.zero1 import ZeRO1 as Contract


class ZeRO1(Contract):
    def post_backward(self) -> None:
        params = [s.param for group in self.groups for s in group.segments]
        here = [id(p) in self._used for p in params]
        self._used.clear()
        if self.find_unused_parameters:  # a gradient on any rank? the same answer everywhere
            flags = torch.tensor([float(h) for h in here])
            self.comm.all_reduce(flags, ReduceOp.MAX)
            here = [f > 0 for f in flags.tolist()]
        anywhere = {id(p) for p, h in zip(params, here, strict=True) if h}
        r = self.rank
        for g, (group, buffer) in enumerate(zip(self.groups, self.full_grads.buffers, strict=True)):
            lo, hi = r * group.shard_size, (r + 1) * group.shard_size
            owned = buffer[lo:hi]
            self.comm.reduce_scatter(owned, buffer, ReduceOp.AVG, wire=self.wire, key=g)
            buffer[:lo].zero_()
            buffer[hi:].zero_()
            for piece in group.pieces:
                mean = owned[piece.offset:piece.offset + piece.stop - piece.start]
                carried = piece.param.grad
                if carried is not None and carried.data_ptr() != mean.data_ptr():
                    mean += carried
                    piece.param.grad = mean
                elif id(piece.segment.param) in anywhere:
                    piece.param.grad = mean
        self.full_grads.window_open = False

    def all_gather_parameters(self) -> None:
        for group in self.groups:
            mine = group.shard.clone()  # the shard is part of the buffer the all-gather fills
            self.comm.all_gather(group.data, mine)
        self.remember_shared()

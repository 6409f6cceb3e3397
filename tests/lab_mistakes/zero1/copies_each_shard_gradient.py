"""Takes the averaged shard as fresh tensors -- each piece's ``.grad`` a ``clone()`` of its range of the buffer (plus
what it carried), not a view into it: the optimizer steps the same numbers and the bytes are the same, but every
rank now holds its shard's gradients twice (4 Psi / N bytes more than ZeRO-1's formula)."""
from __future__ import annotations

from minizero.comm import ReduceOp
from minizero.course.labs import given


class ZeRO1(given.ZeRO1):
    def post_backward(self) -> None:
        used = self.used_anywhere([s.param for group in self.groups for s in group.segments])
        for index, (group, buffer) in enumerate(zip(self.groups, self.full_grads.buffers, strict=True)):
            self.comm.reduce_scatter(group.shard_of(buffer), buffer, ReduceOp.AVG,
                                     tag=self.tag(f"group {index} gradients"), wire=self.wire, key=index)
            owned = group.shard_of(buffer)
            lo, hi = group.rank * group.shard_size, (group.rank + 1) * group.shard_size
            buffer[:lo].zero_()
            buffer[hi:].zero_()
            for piece in group.pieces:
                mine = owned[piece.offset:piece.offset + piece.stop - piece.start]
                if piece.param.grad is not None and piece.param.grad.data_ptr() != mine.data_ptr():
                    piece.param.grad = mine + piece.param.grad
                elif id(piece.segment.param) in used:
                    piece.param.grad = mine.clone()
        self.full_grads.window_open = False

    def all_gather_parameters(self) -> None:
        for g, group in enumerate(self.groups):
            self.comm.all_gather(group.data, group.shard.detach().clone(), tag=self.tag(f"group {g} parameters"))
        self.remember_shared()

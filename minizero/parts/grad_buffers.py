"""ZeRO-1's full gradients: one flat buffer per group, every ``.grad`` a view into it.

ZeRO-1 (and the parameter server, ZeRO-1 on a star) keeps every gradient in
full until the reduction: autograd accumulates into the flat buffer the
reduce-scatter (or push) then reads in place.  After it, this rank's shard of
the buffer holds the averaged gradient -- the pieces' ``.grad`` -- and the
other ranks' shards are zeroed: they averaged those.

Accumulation without ``zero_grad()`` in between adds to the averaged gradient,
as ``.grad`` does in torch.  So when the next accumulation window opens (at its
first forward) a piece that still holds a gradient moves it into a copy of its
own, added back after the next reduction -- left in the buffer, only its owner
would contribute it to the mean.  A piece whose ``.grad`` someone set to None
starts from zero.
"""
from __future__ import annotations

import torch
from torch import nn

from .flat import keep_grad_in
from .layout import FlatGroup


class FullGradients:
    def __init__(self, groups: list[FlatGroup]):
        self.groups = groups
        self.buffers = [torch.zeros_like(g.data) for g in groups]
        self._slot = {id(s.param): (g, s) for g, group in enumerate(groups) for s in group.segments}
        self.window_open = False

    def keep(self, param: nn.Parameter) -> None:
        """``param.grad`` is final for this backward: make sure it is (again) the view into its buffer."""
        g, s = self._slot[id(param)]
        keep_grad_in(param, self.buffers[g][s.start:s.stop].view(s.shape))

    def open_window(self) -> None:
        """A new accumulation window: pieces that still hold a gradient carry it in a copy of their own until
        the reduction -- and whatever is done to their ``.grad`` meanwhile (zeroed, set to None) is what
        gets added back."""
        self.window_open = True
        for group, buffer in zip(self.groups, self.buffers, strict=True):
            owned = group.shard_of(buffer)
            if any(piece.param.grad is not None for piece in group.pieces):
                carried = owned.clone()
                for piece in group.pieces:
                    if piece.param.grad is not None:
                        piece.param.grad = carried[piece.offset:piece.offset + piece.stop - piece.start]
            owned.zero_()

    def open_if_closed(self) -> None:
        """A new window unless one is open: called at a forward with autograd on, and as a backward begins -- a
        backward may follow no forward since the window closed (two forwards, then two backwards; a retained
        graph), and it needs a window too, else the owner's averaged shard would go into the next mean as its
        own gradient, and (N-1)/N of it would be lost."""
        if not self.window_open:
            self.open_window()

    def take_averaged(self, index: int, used: set[int]) -> None:
        """Group ``index``'s shard of its buffer now holds the mean: it becomes the pieces' ``.grad`` (plus what
        they carried); the other shards are zeroed -- what accumulates next is new."""
        group, buffer = self.groups[index], self.buffers[index]
        owned = group.shard_of(buffer)
        lo, hi = group.rank * group.shard_size, (group.rank + 1) * group.shard_size
        buffer[:lo].zero_()
        buffer[hi:].zero_()
        for piece in group.pieces:
            view = owned[piece.offset:piece.offset + piece.stop - piece.start]
            if piece.param.grad is not None and piece.param.grad.data_ptr() != view.data_ptr():
                view.add_(piece.param.grad)  # carried from before this window
                piece.param.grad = view
            elif id(piece.segment.param) in used:
                piece.param.grad = view

    def zero(self) -> None:
        """``zero_grad()``: the buffers zeroed, every ``.grad`` a view into them again."""
        self.window_open = False
        for group, buffer in zip(self.groups, self.buffers, strict=True):
            buffer.zero_()
            for s in group.segments:
                s.param.grad = buffer[s.start:s.stop].view_as(s.param)

"""``no_sync()`` restores the flag after the block, but not when the block raises (no try/finally)."""
from __future__ import annotations

from contextlib import contextmanager

from minizero.course.labs import given


class Wire(given.Wire):
    def encode(self, flat, key=None):
        return (flat / self.pre).to(self.wire_dtype)

    def decode(self, wire, out, key=None, where="a gradient buffer") -> None:
        out.copy_(wire.to(out.dtype).div_(self.post))


class DDP(given.CompressDDP):
    wire_class = Wire

    @contextmanager
    def no_sync(self):
        previous = self.require_backward_grad_sync
        self.require_backward_grad_sync = False
        yield
        self.require_backward_grad_sync = previous

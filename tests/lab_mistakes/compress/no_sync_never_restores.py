"""``no_sync()`` turns synchronisation off and never turns it back on."""
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
        self.require_backward_grad_sync = False
        yield

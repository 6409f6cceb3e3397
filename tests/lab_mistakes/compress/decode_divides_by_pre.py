"""``decode`` divides the sum by ``pre`` again instead of by ``post``."""
from __future__ import annotations

from contextlib import contextmanager

from minizero.course.labs import given


class Wire(given.Wire):
    def encode(self, flat, key=None):
        return (flat / self.pre).to(self.wire_dtype)

    def decode(self, wire, out, key=None, where="a gradient buffer") -> None:
        out.copy_(wire.to(out.dtype).div_(self.pre))


class DDP(given.CompressDDP):
    wire_class = Wire

    @contextmanager
    def no_sync(self):
        previous = self.require_backward_grad_sync
        self.require_backward_grad_sync = False
        try:
            yield
        finally:
            self.require_backward_grad_sync = previous

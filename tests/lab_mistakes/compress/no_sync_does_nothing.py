"""``no_sync()`` yields without turning synchronisation off: every micro-batch's backward all-reduces, and the
sums still come out right -- K all-reduces a step where one would do."""
from __future__ import annotations

from contextlib import contextmanager

from minizero.course.labs import given


class Wire(given.Wire):
    def encode(self, flat, key=None):
        return flat.div(self.pre).to(self.wire_dtype)

    def decode(self, wire, out, key=None, where="a gradient buffer") -> None:
        mean = wire.to(out.dtype)
        mean /= self.post
        out.copy_(mean)


class DDP(given.CompressDDP):
    wire_class = Wire

    @contextmanager
    def no_sync(self):
        yield

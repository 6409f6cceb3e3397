"""``no_sync()``: gradient accumulation's switch, torch DDP's idiom, the one context manager every stage shares.

Inside the block a backward synchronises nothing -- the gradients add up locally -- and the first backward outside
averages the sums: K micro-batches, one synchronisation per optimizer step (lesson 6).  A stage reads the switch,
``require_backward_grad_sync`` (torch's name), at each forward.  :class:`~minizero.stages.base.Stage` takes it as
its method.  It has a file of its own because it is the answer to lesson 6's lab (``compress``), while the helpers
of :mod:`minizero.stages.base` -- ``tag``, ``stepping``, ``trainable`` -- are what the labs before it send their
readers to (issue 45).
"""
from __future__ import annotations

from contextlib import contextmanager


@contextmanager
def no_sync(self):
    """Accumulate gradients locally; synchronise on the first backward after the block (also when the block raises,
    and when blocks nest: the switch is put back as it was on entering)."""
    previous = self.require_backward_grad_sync
    self.require_backward_grad_sync = False
    try:
        yield
    finally:
        self.require_backward_grad_sync = previous

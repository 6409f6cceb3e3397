"""Stage ``ddp``: the simplest correct data parallelism.

Every rank holds the whole model and a different slice of the global batch.
If all replicas start equal and apply the same update, they stay equal, and
the update equals single-device training on the global batch when it uses
the *average* of the ranks' gradients (the gradient of a mean is the mean of
the gradients).  So:

1. at wrap time, broadcast rank 0's parameters (ranks may have initialised
   differently);
2. when backward finishes, all-reduce (average) every gradient;
3. step the ordinary optimizer, identically on every rank.

The all-reduce runs once per backward, over one flat buffer per dtype, so
its cost is the ring all-reduce of the gradients: 2(N-1)/N * Psi * b bytes per
rank.  Inside ``no_sync()`` nothing is sent and gradients accumulate locally;
the first backward after it averages the accumulated sums (torch's idiom).

Every rank must put the same parameters in the buffer.  A parameter without
a gradient is refused, named -- or, with ``find_unused_parameters=True``, the
ranks first all-reduce a bitmap of who used what (as torch DDP does), so a
parameter used on some ranks only is averaged with zeros and one used nowhere
is not stepped, exactly as on a single device.
"""
from __future__ import annotations

import torch
from torch import nn

from ..comm import Comm
from ..compress import GradientAverager
from ..flat import group_by_dtype, pack, unpack
from .base import Synchronised, agree_on_use, unused_error
from .wrap import broadcast_module, check_same_model


class DDP(Synchronised):
    name = "ddp"

    def __init__(self, module: nn.Module, optimizer: torch.optim.Optimizer, comm: Comm,
                 compress: str | None = None, error_feedback: bool = False, find_unused_parameters: bool = False):
        super().__init__(module, optimizer, comm, find_unused_parameters)
        self.averager = GradientAverager(comm, compress, error_feedback)
        for name, p in self.trainable():
            self.averager.check_gradient_dtype(name, p.dtype)
        check_same_model(module, comm)
        broadcast_module(module, comm)

    def sync_gradients(self) -> None:
        """Average every gradient across ranks: one flat all-reduce per dtype."""
        grads = [p.grad for p in self._with_gradient()]
        for dtype, group in group_by_dtype(grads).items():
            flat = pack(group)
            self.averager(flat, dtype, tag=self.tag(f"gradients ({str(dtype).replace('torch.', '')})"))
            unpack(flat, group)

    def _with_gradient(self) -> list[nn.Parameter]:
        """The parameters the flat buffer holds -- the same list on every rank.

        Packing "whatever has a gradient here" would pair rank 0's gradient of one
        parameter with rank 1's of another whenever ranks use different parameters.
        So either every parameter must have a gradient (checked here, no
        communication), or, with ``find_unused_parameters``, the ranks agree first."""
        named = self.trainable()
        if not self.find_unused_parameters:
            missing = [n for n, p in named if p.grad is None]
            if missing:
                raise unused_error(self.rank, missing, "the ranks would disagree on what the flat buffer holds")
            return [p for _, p in named]
        used = agree_on_use(self.comm, [p.grad is not None for _, p in named], self.tag("used-parameter bitmap"))
        for (_, p), anywhere in zip(named, used):
            if anywhere and p.grad is None:
                p.grad = torch.zeros_like(p)  # this rank's share of a gradient that exists elsewhere
        return [p for (_, p), anywhere in zip(named, used) if anywhere]

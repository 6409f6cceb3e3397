"""Known mistakes of the mixed-precision lab: ZeRO-2 whose masters make one classic slip each.

As in :mod:`minizero.course.labs.mistakes`: each is a stage with a ``mistake`` sentence
(second person) and a ``name`` under which the checker runs it beside a
learner's failing case, to name the slip when the numbers agree.  They join the
labs' registry (:data:`~minizero.course.labs.mistakes.LAB_MISTAKES`) here, never the
package's.
"""
from __future__ import annotations

import torch

from ...parts.masters import MasterWeights
from ...stages import ZeRO2, registry
from .mistakes import LAB_MISTAKES


class _OwnVerdict(MasterWeights):
    def _agree_on_overflow(self) -> bool:
        return any(not bool(torch.isfinite(m.grad).all()) for m in self.masters if m.grad is not None)


class OwnOverflowVerdict(ZeRO2):
    """Each rank decides on its own shard: an inf in one rank's shard skips the step there only."""

    mistake = ("each rank decided on its own gradients whether the step overflowed: an inf on one rank skipped the "
               "step there while the others took it -- all-reduce the overflow flag with MAX, so every rank decides "
               "alike")
    name = "mixed-own-overflow-verdict"
    master_class = _OwnVerdict


class _Scaled(MasterWeights):
    @torch.no_grad()
    def unscale_(self) -> bool:
        if self.optimizer_outside:
            return False
        if self._overflow is None:
            for w, m in zip(self.working, self.masters, strict=True):
                m.grad = None if w.grad is None else w.grad.to(m.dtype, copy=True)  # never divided by the scale
            self._overflow = self._agree_on_overflow() if self.scaler else False
        return self._overflow


class NeverUnscales(ZeRO2):
    """Steps the masters on the scaled gradients: in fp16 every update is S times too large."""

    mistake = ("the masters stepped on the scaled gradients: in fp16 each update was the loss scale S times too large "
               "-- divide each gradient by S (in fp32) before the step")
    name = "mixed-never-unscales"
    master_class = _Scaled


MISTAKES = (OwnOverflowVerdict, NeverUnscales)
LAB_MISTAKES.update(registry(*MISTAKES))

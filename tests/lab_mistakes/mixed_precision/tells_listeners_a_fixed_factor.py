"""Tells the listeners a fixed factor -- 0.5 after an overflow, else 1 -- instead of the scale's own change: right
while the scale only halves, wrong when it doubles after a window of clean steps (error feedback's residuals are then
kept at the old scale)."""
from __future__ import annotations

import torch

from minizero.comm import ReduceOp
from minizero.course.labs import given


class MasterWeights(given.MasterWeights):
    @torch.no_grad()
    def unscale_(self) -> bool:
        if self.optimizer_outside:
            return False
        if self._overflow is None:
            for w, m in zip(self.working, self.masters, strict=True):
                m.grad = None if w.grad is None else w.grad.to(m.dtype) / self.loss_scale
            self._overflow = self._agree_on_overflow() if self.scaler else False
        return self._overflow

    def _agree_on_overflow(self) -> bool:
        bad = any(not torch.isfinite(m.grad).all() for m in self.masters if m.grad is not None)
        flag = torch.tensor([1.0 if bad else 0.0])
        self.comm.all_reduce(flag, ReduceOp.MAX, tag=self.tag("overflow flag"))
        return flag.item() > 0

    @torch.no_grad()
    def step(self, optimizer_step) -> bool:
        overflow = self.unscale_()
        try:
            if overflow:
                self._refuse_overflow_at_the_floor()
                return False
            optimizer_step()
            self.refresh()
            return True
        finally:
            for m in self.masters:
                m.grad = None
            if self.scaler:
                self.scaler.update(overflow)
            self._overflow = None
            for listener in self.settled:
                listener(not overflow, 0.5 if overflow else 1.0)

    @torch.no_grad()
    def refresh(self) -> bool:
        changed = False
        for i, (w, m) in enumerate(zip(self.working, self.masters, strict=True)):
            if m._version != self._refreshed[i]:
                w.copy_(m)
                self._refreshed[i] = m._version
                changed = True
        return changed


class ZeRO2(given.MixedZeRO2):
    master_class = MasterWeights

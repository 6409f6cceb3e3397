"""Tells the scaler of the overflow first, then refuses "at the floor": at loss scale 2 the scaler has already halved
to the minimum, 1, so a NaN one halving above the floor -- which the package skips -- ends the run as divergence."""
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
        overflow, scale = self.unscale_(), self.loss_scale
        told = [False]
        try:
            if overflow:
                self.scaler.update(True)
                told[0] = True
                self._refuse_overflow_at_the_floor()
                return False
            optimizer_step()
            self.refresh()
            return True
        finally:
            for m in self.masters:
                m.grad = None
            if self.scaler and not told[0]:
                self.scaler.update(overflow)
            self._overflow = None
            for listener in self.settled:
                listener(not overflow, self.loss_scale / scale)

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

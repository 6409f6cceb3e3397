"""Everything the step owes but one: the listeners in ``self.settled`` are never told whether the step was taken or
how the loss scale moved -- a 16-bit wire with error feedback then keeps a skipped step's residuals, in the old
scale's units (2.4e-4 off under fp16, a bf16 wire and error feedback; issue 45)."""
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
            self._overflow = self.scaler is not None and self._agree_on_overflow()
        return self._overflow

    def _agree_on_overflow(self) -> bool:
        bad = any(not torch.isfinite(m.grad).all() for m in self.masters if m.grad is not None)
        flag = torch.tensor([1.0 if bad else 0.0])
        if self.comm is not None:
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
            if self.scaler is not None:
                self.scaler.update(overflow)
            self._overflow = None

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

"""Forgets that with the optimizer built after wrapping the gradients were handed over, unscaled, at the end of
backward (the working ones freed): clipping's ``unscale_`` sets every master's gradient from None again."""
from __future__ import annotations

import torch

from minizero.comm import ReduceOp
from minizero.course.labs.skeletons.contract import mixed_precision as contract


class MasterWeights(contract.MasterWeights):
    @torch.no_grad()
    def unscale_(self) -> bool:
        if self._overflow is None:  # the handed-over case forgotten: unscaled again from the freed working gradients
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
        overflow, scale = self.unscale_(), self.loss_scale
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


class ZeRO2(contract.ZeRO2):
    master_class = MasterWeights

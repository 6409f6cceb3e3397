"""Lab ``mixed-precision`` in another style: the overflow found as a count of non-finite gradients, agreed by a SUM,
the unscale written in place on a copy, and step's closing duties in one helper that each path calls."""
from __future__ import annotations

import torch

from minizero.comm import ReduceOp
from minizero.course.labs.skeletons.contract import mixed_precision as contract


class MasterWeights(contract.MasterWeights):
    @torch.no_grad()
    def unscale_(self) -> bool:
        if self.optimizer_outside:
            return False
        if self._overflow is not None:
            return self._overflow
        for w, m in zip(self.working, self.masters, strict=True):
            m.grad = None if w.grad is None else w.grad.to(m.dtype, copy=True).div_(self.loss_scale)
        self._overflow = False if self.scaler is None else self._agree_on_overflow()
        return self._overflow

    def _agree_on_overflow(self) -> bool:
        count = torch.zeros(1)
        for m in self.masters:
            if m.grad is not None:
                count += (~torch.isfinite(m.grad)).sum()
        if self.comm is not None:
            self.comm.all_reduce(count, ReduceOp.SUM, tag=self.tag("overflow flag"))
        return bool(count.item() > 0)

    def _settle(self, overflow: bool, scale: float) -> None:
        for m in self.masters:
            m.grad = None
        if self.scaler is not None:
            self.scaler.update(overflow)
        self._overflow = None
        for listener in self.settled:
            listener(not overflow, self.loss_scale / scale)

    @torch.no_grad()
    def step(self, optimizer_step) -> bool:
        overflow, scale = self.unscale_(), self.loss_scale
        if overflow:
            try:
                self._refuse_overflow_at_the_floor()
            finally:
                self._settle(overflow, scale)
            return False
        optimizer_step()
        self.refresh()
        self._settle(overflow, scale)
        return True

    @torch.no_grad()
    def refresh(self) -> bool:
        changed = False
        for i in range(len(self.working)):
            if self.masters[i]._version != self._refreshed[i]:
                self.working[i].copy_(self.masters[i])
                self._refreshed[i] = self.masters[i]._version
                changed = True
        return changed


class ZeRO2(contract.ZeRO2):
    master_class = MasterWeights

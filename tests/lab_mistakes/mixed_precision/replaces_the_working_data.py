"""``refresh`` rounds each master into a new tensor and points the working parameter at it (``w.data = m.to(...)``,
the old apex idiom) instead of copying into it: each working value is right, but under ZeRO-2 a working parameter
is a view into the flat buffer the step's all-gather sends -- now left behind, so the ranks share stale shards."""
from __future__ import annotations

import torch

from minizero.comm import ReduceOp
from minizero.course.labs.skeletons.guided import mixed_precision as skeleton


class MasterWeights(skeleton.MasterWeights):
    @torch.no_grad()
    def unscale_(self) -> bool:
        if self.optimizer_outside:
            return False
        if self._overflow is None:
            inverse = 1.0 / self.loss_scale
            for w, m in zip(self.working, self.masters, strict=True):
                m.grad = None if w.grad is None else w.grad.to(m.dtype).mul_(inverse)
            self._overflow = self._agree_on_overflow() if self.scaler else False
        return self._overflow

    def _agree_on_overflow(self) -> bool:
        flag = torch.zeros(1)
        for m in self.masters:
            if m.grad is not None and not torch.isfinite(m.grad).all():
                flag.fill_(1.0)
        self.comm.all_reduce(flag, ReduceOp.MAX, tag=self.tag("overflow flag"))
        return bool(flag.item() > 0)

    @torch.no_grad()
    def step(self, optimizer_step) -> bool:
        overflow, stepped, scale = self.unscale_(), False, self.loss_scale
        try:
            if overflow:
                self._refuse_overflow_at_the_floor()
                return False
            optimizer_step()
            self.refresh()
            stepped = True
            return True
        finally:
            for m in self.masters:
                m.grad = None
            if self.scaler:
                self.scaler.update(overflow)
            self._overflow = None
            for listener in self.settled:
                listener(stepped, self.loss_scale / scale)

    @torch.no_grad()
    def refresh(self) -> bool:
        changed = False
        for i, (w, m) in enumerate(zip(self.working, self.masters, strict=True)):
            if m._version != self._refreshed[i]:
                w.data = m.to(w.dtype)
                self._refreshed[i] = m._version
                changed = True
        return changed


class ZeRO2(skeleton.ZeRO2):
    master_class = MasterWeights

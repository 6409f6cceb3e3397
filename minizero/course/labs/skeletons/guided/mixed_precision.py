"""Lab mixed-precision -- the step through fp32 master weights (lessons/10_mixed_precision.ipynb).
Guided level: each method says what to do and which parts exist; the contract level states only what must hold.

Given: ZeRO-2 in mixed precision (``MixedZeRO2``: the package's, building its masters from
``master_class``), and on ``MasterWeights`` the pairs ``self.working[i]`` (16-bit, ``.grad`` from backward,
in fp16 multiplied by the loss scale) / ``self.masters[i]`` (fp32 ``nn.Parameter``: what the optimizer steps),
``self.loss_scale``, ``self.scaler`` (fp16's ``LossScaler``, None in bf16), ``self.comm`` and ``self.tag``,
``self._overflow`` (the verdict of this step, None until decided), ``self.optimizer_outside``,
``self._refreshed`` (each master's ``_version`` when last rounded), ``self._refuse_overflow_at_the_floor()`` and
``hand_over()`` (the optimizer-outside path's end of backward; it calls your ``_agree_on_overflow``).
Yours: unscale, agree on overflow, step, refresh -- lesson 10's recipe.

Check it:   python -m minizero check mixed-precision --impl THIS_FILE
The checker first drives your class alone on every rank beside the package's (an inf on one rank must skip the
step on all of them), then trains ZeRO-2 with it in fp16 and bf16 against the same-recipe reference.
"""
from __future__ import annotations

from typing import Callable

import torch

from minizero.comm import ReduceOp  # noqa: F401 -- for your _agree_on_overflow
from minizero.course.labs.given import MasterWeights as GivenMasterWeights
from minizero.course.labs.given import MixedZeRO2 as GivenZeRO2


class MasterWeights(GivenMasterWeights):
    @torch.no_grad()
    def unscale_(self) -> bool:
        """The masters' fp32 gradients, and whether to skip this step.

        1. With ``self.optimizer_outside`` there is nothing to do (``hand_over`` already unscaled into the
           masters): return False.
        2. Only if ``self._overflow`` is None (clipping may have called this already this step): give each master
           a ``.grad`` -- its working gradient widened to the master's dtype first, then divided by the loss
           scale (a power of two: exact in fp32, not in 16 bits, where small gradients lose their bits); None
           where the working gradient is None.  Then set ``self._overflow``: the agreed verdict if there is a
           scaler (fp16), else False.
        3. Return ``self._overflow``."""
        raise NotImplementedError("write MasterWeights.unscale_: fp32 gradients / S, and the verdict, once a step")

    def _agree_on_overflow(self) -> bool:
        """A flag -- 1 if any master's gradient here has an element that is not finite (inf or NaN), else 0 --
        all-reduced across ranks with MAX through ``self.comm`` (tag it: ``self.tag("overflow flag")``), once for
        all the masters; True if the result is above 0.  A rank may own no master at all: its flag is 0."""
        raise NotImplementedError("write MasterWeights._agree_on_overflow: the same verdict on every rank")

    @torch.no_grad()
    def step(self, optimizer_step: Callable[[], None]) -> bool:
        """1. ``overflow = self.unscale_()``.
        2. On overflow: ``self._refuse_overflow_at_the_floor()`` and touch nothing; the result is False.
           Else: ``optimizer_step()``, then ``self.refresh()`` (the stepped masters into the working copy); True.
        3. In every case, before returning (a ``finally``): every master's ``.grad`` back to None, the scaler
           (if any) told ``update(overflow)``, ``self._overflow`` back to None, and each ``listener`` in
           ``self.settled`` called as ``listener(stepped, self.loss_scale / scale)`` -- ``scale`` the loss scale
           before the step (a 16-bit wire with error feedback keeps or drops its residuals by it)."""
        raise NotImplementedError("write MasterWeights.step: skip on overflow, else step and round")

    @torch.no_grad()
    def refresh(self) -> bool:
        """For each pair whose master's ``_version`` differs from ``self._refreshed[i]`` (torch bumps it at every
        in-place change): copy the master into the working tensor in place (``copy_``: the one rounding to 16
        bits) and remember the new version.  Leave the others alone -- not even rewritten.  Return whether any
        was copied."""
        raise NotImplementedError("write MasterWeights.refresh: round the changed masters into the working copy")


class ZeRO2(GivenZeRO2):
    master_class = MasterWeights  # the stage builds its masters from this class: yours

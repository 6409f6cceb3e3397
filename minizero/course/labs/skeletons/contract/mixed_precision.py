"""Lab mixed-precision -- the step through fp32 master weights (lessons/10_mixed_precision.ipynb).

Contract level: each method states what must hold after it runs and what the checker holds it to -- not how.
(The guided level says which parts of minizero exist for it:
``python -m minizero lab mixed-precision FILE --level guided``.)

The stage is ZeRO-2 under ``precision="fp16"`` or ``"bf16"``: the model computes with a 16-bit working copy,
backward leaves 16-bit gradients -- in fp16, of the loss times the loss scale S -- ZeRO-2 reduce-scatters them,
and each rank's optimizer steps the fp32 masters of its own shard.  What happens between the averaged 16-bit
gradients and the next forward is yours: the four methods of ``MasterWeights``.  Your bases,
``minizero.course.labs.given``'s ``MasterWeights`` and ``MixedZeRO2``, are the package's without those methods; the
stage builds its masters from its ``master_class``: keep that your ``MasterWeights``.

The state the contract speaks of (all given, on ``self``):
  * ``working[i]``: a 16-bit tensor (a piece of a parameter) whose ``.grad`` backward filled, or None;
    ``masters[i]``: its fp32 master, an ``nn.Parameter`` -- what the optimizer steps;
  * ``loss_scale``: S (1.0 in bf16); ``scaler``: the loss scaler in fp16 (None in bf16), whose
    ``update(overflow)`` halves S after an overflow and counts the skipped step;
  * ``comm``: the ranks' communication layer (its all-reduce takes a ``ReduceOp``: MAX among them), ``tag(what)``;
  * ``_overflow``: this step's verdict once decided, None before (``reset()``, at zero_grad, sets None);
  * ``optimizer_outside``: the optimizer was built after wrapping, over the masters, and the user steps it;
  * ``_refreshed[i]``: ``masters[i]._version`` when it was last rounded into ``working[i]``;
  * ``_refuse_overflow_at_the_floor()``: raises when S is at its minimum (divergence, not a too-large scale).

The checker's properties, in order:
  1. your methods are what runs: all four are defined here and called in a step (fp16, K = 2);
  2. the step on every rank, against the package's on the same gradients, bit for bit: first an inf in rank 1's
     gradient only (every rank must skip), then drawn cases -- world sizes 1-4, fp16 and bf16, loss scales, an
     inf or NaN in one element of one rank's gradient, the minimum scale, clipping first, the optimizer before or
     after wrapping, tensors without a gradient or without elements -- and then, whatever was drawn, a NaN at the
     minimum scale, one a halving above it, a scale that grows every clean step, and clipping with the optimizer
     built after wrapping.  Masters, working copy, loss scale, skipped steps and optimizer state must equal the
     package's; the fp32 gradients freed; at most one all-reduce a step;
  3. ZeRO-2 training with your masters equals the same-recipe reference (the same 16-bit arithmetic on one
     device): fp16 whose scale overflows and an inf on one rank, bf16, world sizes 1-4, K up to 3, the edge
     model, clipping, the optimizer before and after wrapping -- the same skipped steps and scales on every rank.

Check it:   python -m minizero check mixed-precision --impl THIS_FILE
"""
from __future__ import annotations

from typing import Callable

from minizero.course.labs.given import MasterWeights as GivenMasterWeights
from minizero.course.labs.given import MixedZeRO2 as GivenZeRO2


class MasterWeights(GivenMasterWeights):
    def unscale_(self) -> bool:
        """Returns True if this step must be skipped (an inf or NaN on some rank).  Called once or twice a step:
        by clipping (before the step, which clips the masters' gradients) and by :meth:`step`.

        The first call since the last step (or since ``reset()``) leaves each master's ``.grad`` equal, bit for
        bit, to its working gradient converted to the master's dtype and then divided by S there (None where the
        working gradient is None), and decides the verdict: in fp16 the ranks' agreed one; in bf16, False.  A
        second call in the same step changes nothing and returns the same verdict (no second collective).  With
        ``optimizer_outside``, returns False and changes nothing: the gradients were handed over, unscaled, at the
        end of backward."""
        raise NotImplementedError("write MasterWeights.unscale_: fp32 gradients / S, and the verdict, once a step")

    def _agree_on_overflow(self) -> bool:
        """True if any master's ``.grad`` on any rank holds an inf or NaN -- the same answer on every rank, though
        each rank sees only its own shard.  One collective, of one value."""
        raise NotImplementedError("write MasterWeights._agree_on_overflow: the same verdict on every rank")

    def step(self, optimizer_step: Callable[[], None]) -> bool:
        """One optimizer step through the masters; returns True if taken (ZeRO-1/2 all-gather the shards only
        then).  On an overflow: nothing changes -- masters, optimizer state, working copy -- and at the minimum
        scale it raises.  Otherwise ``optimizer_step()`` steps the masters and each stepped master is rounded
        into its working copy (by :meth:`refresh`).  Either way, when it returns: every master's ``.grad`` is
        None (transient, not state between steps), the scaler was told whether the step overflowed, each
        listener in ``self.settled`` was called once as ``listener(taken, new_scale / old_scale)`` (a 16-bit
        wire's error feedback keeps its residuals by it), and the next call of :meth:`unscale_` decides afresh."""
        raise NotImplementedError("write MasterWeights.step: skip on overflow, else step and round")

    def refresh(self) -> bool:
        """Each master whose value changed since it was last rounded is rounded into its working copy (a copy:
        the working tensor stays the same object -- the model's parameter, or a view into ZeRO's flat buffer);
        the others are not written at all (ZeRO-1/2 take a write to the working copy for a step to all-gather).
        Returns True if any was rounded.  With ``optimizer_outside`` the stage calls it before each forward."""
        raise NotImplementedError("write MasterWeights.refresh: round the changed masters into the working copy")


class ZeRO2(GivenZeRO2):
    master_class = MasterWeights  # the stage builds its masters from this class: yours

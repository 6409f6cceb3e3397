"""Sharing the updated shards after a step -- ZeRO-1's and ZeRO-2's, which keep full parameters between steps: an
all-gather of the groups the step changed (:func:`stepped_groups`), noted when done (:func:`remember_shared`); an
optimizer built over ``stage.parameters()`` steps outside the stage, which then shares at the next forward
(:func:`stepped_outside`).  ZeRO-3 keeps no full parameters.  Methods of the ZeRO family (``self`` is the stage).
"""
from __future__ import annotations

import torch

from ..comm import ReduceOp


def stepped_groups(self):
    """``(index, group)`` of the flat groups the last step changed: those with a gradient anywhere since the
    last all-gather -- the ones whose updated shards must be shared (a group no rank had a gradient for did not
    move).  Since the last all-gather, not since the last ``zero_grad()``: with the optimizer outside the stage,
    a loop's ``model.zero_grad()`` comes between its ``optimizer.step()`` and the next forward, which shares."""
    stepped = self._has_grad | self._unshared
    return [(g, group) for g, group in enumerate(self.groups)
            if any(id(s.param) in stepped for s in group.segments)]


def remember_shared(self) -> None:
    """The full parameters are current now (all-gathered, or loaded): note each group's version."""
    self._shared_versions = [self._version_of(group) for group in self.groups]
    self._synchronised_at_share = self.synchronised
    self._unshared.clear()

def stepped_outside(self) -> bool:
    """Did anything write the owned shards since the last all-gather -- an optimizer built over
    ``stage.parameters()``, which the stage does not drive?  The parameters' version counter says:
    every in-place update of a piece bumps it (evaluation forwards and backward do not).  ZeRO-1 and
    ZeRO-2 all-gather then, at the next forward; ZeRO-3 keeps no full parameters to bring up to date.

    The ranks must agree: a rank whose pieces the step left alone (none had a gradient, or it owns none)
    sees no change where the others do, and would leave them waiting in the all-gather.  So, with the
    optimizer outside, the first forward after new gradients asks every rank (a MAX of one flag)."""
    if not self._shared_versions:
        return False
    changed = any(self._version_of(group) != version
                  for group, version in zip(self.groups, self._shared_versions, strict=True))
    if self.user_optimizer is not None or self.synchronised == self._synchronised_at_share:
        return changed  # the stage steps its optimizer itself (and shares at once), or no gradient came
    flag = torch.tensor([float(changed)])
    self.comm.all_reduce(flag, ReduceOp.MAX, tag=self.tag("stepped since the last all-gather?"))
    return bool(flag.item())

def version_of(group) -> int:
    """What an in-place step of the owned shard bumps: the full buffer's version (the shard views it)."""
    return group.data._version

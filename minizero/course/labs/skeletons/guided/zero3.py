"""Lab 9 -- ZeRO-3: gather a unit's parameters around its forward and backward, free them after (lessons/09_zero3.ipynb).
Guided level: each method says what to do and which parts exist; the contract level states only what must hold.

Given: the stage: one sharded flat group per unit, param group and dtype (each
``ShardedFlatGroup`` holding only its owned ``shard`` until gathered), the stage's
hooks that call a unit's four moments (``unit.pre_forward()`` before the unit's
forward, ``unit.post_forward(reshard)`` after it, ``unit.pre_backward()`` before its
backward, and, once a group's gradients are packed for their reduce-scatter,
``unit.post_backward(group)``), and the unit's gathering and freeing:
``start_gather(why)`` starts the unit's all-gather on the communication thread --
now, or earlier as a prefetch -- and leaves the work in ``self._gathering``;
``reshard()`` frees every group, ``_free(group)`` one (both tell the stage's memory
observer).
Yours: the unit -- ``unshard`` and its four moments: when full parameters exist, and when they go.

Check it:   python -m minizero check zero3 --impl THIS_FILE
Besides equivalence, the checker counts the bytes -- two all-gathers and a
reduce-scatter, 3(N-1)/N x Psi x b, 1.5x DDP's (two-thirds of that without
resharding after forward) -- and the parameters each rank holds after a step:
1/N of them.
"""
from __future__ import annotations

from minizero.course.labs.given import Unit as GivenUnit
from minizero.course.labs.given import ZeRO3 as GivenZeRO3


class Unit(GivenUnit):
    def unshard(self, why: str) -> None:
        """Full parameters, now.  Start the all-gather unless a prefetch already did (``start_gather`` does
        nothing if one is running or the unit is gathered); then, if an all-gather is in flight, wait for its
        result -- one full flat buffer per group, in ``self.groups``' order -- point each group at its buffer
        (a ``ShardedFlatGroup`` has a method for that), and forget the finished work."""
        raise NotImplementedError("write Unit.unshard: wait for the all-gather, use the full buffers")

    def pre_forward(self) -> None:
        """The unit is about to compute its forward: its parameters must be whole."""
        raise NotImplementedError("write Unit.pre_forward: the parameters whole before the unit computes")

    def post_forward(self, reshard: bool) -> None:
        """The unit's forward is done.  If ``reshard``, free its full parameters: the backward will gather them
        again -- memory bought with a second all-gather."""
        raise NotImplementedError("write Unit.post_forward: free the full parameters if reshard")

    def pre_backward(self) -> None:
        """The unit's backward is about to run.  Autograd saved the parameters and views of their buffer, not
        copies: gather the unit again (the group refills the storage those views share) and backward computes
        with them."""
        raise NotImplementedError("write Unit.pre_backward: the parameters whole again for backward")

    def post_backward(self, group) -> None:
        """``group``'s gradients were packed for their reduce-scatter: its full parameters can go.  Free this
        group only -- the unit's other groups may still be computing."""
        raise NotImplementedError("write Unit.post_backward: free this group's full parameters")


class ZeRO3(GivenZeRO3):
    unit_class = Unit  # the stage builds its units from this class: yours

"""Lab 9 -- ZeRO-3: gather a unit's parameters around its forward and backward, free them after (lessons/09_zero3.ipynb).

Contract level: each method states what must hold after it runs and what the checker holds it to -- not how.
(The guided level says which parts of minizero exist for it: ``python -m minizero lab zero3 FILE --level guided``.)

You write the unit -- FSDP2's ``FSDPParamGroup``: when a unit's full parameters exist, and when they go.  Your
bases, ``minizero.course.labs.given``'s ``ZeRO3`` and ``Unit``: the package's ZeRO-3 stage, whole, building its units from
its ``unit_class`` (keep that your ``Unit``), and the package's unit without its five methods.  The stage calls a
unit's moments: ``pre_forward()`` before the unit's forward, ``post_forward(reshard)`` after it, ``pre_backward()``
before its backward, and ``post_backward(group)`` once one of its groups' gradients were packed for their
reduce-scatter; it may start a unit's all-gather ahead of use (a prefetch).  Any part of minizero is yours to use.

The state the contract speaks of:
  * ``self.groups`` (``minizero.parts.unit_groups.ShardedFlatGroup``), the unit's flat groups: only the owned ``shard``
    persists; the group is ``gathered`` while its parameters view a full flat buffer (every rank's shard end to
    end; ``use(full)`` points them into one), and between uses they are empty placeholders -- a forward through
    an ungathered unit fails loudly;
  * the given gathering and freeing: ``start_gather(why)`` starts the unit's all-gather on the communication
    thread -- unless one is in flight or the unit is gathered -- and leaves its work in ``self._gathering``
    (``.result()``: one full buffer per group, in ``self.groups``' order); ``reshard()`` frees every group,
    ``_free(group)`` one (both tell the stage's memory observer); ``gathered``: every group is.

The checker's properties, in order:
  1. your methods are what runs: all five are defined in this file and called during a step;
  2. equivalence to single-device training, parameters and optimizer states after every step, on drawn examples:
     world sizes 1-4, K = 1-3 (the first K-1 inside no_sync(), where units stay gathered), uneven batches,
     SGD/momentum/Adam, float64 (<= 1e-9) and float32 (<= 1e-5), prefetch 0-2 units, resharding after forward or
     not, two param groups, clipping, the edge model, backwards inside and outside no_sync() in every order (their
     averages add), the routed model (a branch used by some ranks' micro-batches only, or by none), the optimizer
     built after wrapping;
  3. bytes per step: an all-gather in forward, another in backward and a reduce-scatter,
     3(N-1)/N x Psi x b -- 1.5x DDP's (N = 2 and 3); a unit gathered twice, or never freed, shows here;
  4. memory: after a step each rank holds 16Psi/N bytes of model state (AdamW, N = 4): no full parameter left --
     right after the step the parameters point into no gathered buffer (with two param groups too: a unit of two
     flat groups), and the memory observer's count of gathered bytes agrees with what they point into (a group
     freed or gathered around ``_free``/``start_gather``, which tell it, leaves the memory tools wrong).

Check it:   python -m minizero check zero3 --impl THIS_FILE
"""
from __future__ import annotations

from minizero.course.labs.given import Unit as GivenUnit
from minizero.course.labs.given import ZeRO3 as GivenZeRO3


class Unit(GivenUnit):
    def unshard(self, why: str) -> None:
        """After it: every group of the unit is gathered, its parameters viewing the full buffer of this
        gathering, and no all-gather of the unit is in flight (``self._gathering`` None).  An all-gather already
        in flight (a prefetch) is the one used -- never a second one; a unit already gathered costs nothing.
        ``why`` says what for ("forward", "backward"), for the all-gather's tag."""
        raise NotImplementedError("write Unit.unshard: the unit gathered, from the all-gather in flight or a new one")

    def pre_forward(self) -> None:
        """After it: the unit is gathered, for its forward."""
        raise NotImplementedError("write Unit.pre_forward: the unit gathered for its forward")

    def post_forward(self, reshard: bool) -> None:
        """After it: if ``reshard``, no group of the unit is gathered (the backward gathers them again: memory
        bought with a second all-gather); otherwise the unit is as it was (gathered until its backward)."""
        raise NotImplementedError("write Unit.post_forward: the unit freed if reshard")

    def pre_backward(self) -> None:
        """After it: the unit is gathered, for its backward (autograd saved the parameters and views of their
        buffer, not copies: the gather refills the storage they share)."""
        raise NotImplementedError("write Unit.pre_backward: the unit gathered for its backward")

    def post_backward(self, group) -> None:
        """After it: ``group`` is not gathered (freed, the observer told); the unit's other groups are as they
        were -- they may still be computing."""
        raise NotImplementedError("write Unit.post_backward: this group freed, the others as they were")


class ZeRO3(GivenZeRO3):
    unit_class = Unit  # the stage builds its units from this class: yours

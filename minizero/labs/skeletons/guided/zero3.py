"""Lab 7 -- ZeRO-3: gather a unit's parameters around its forward and backward, free them after (lessons/07_zero3.ipynb).

Given: the stage (``minizero.stages.ZeRO3``): one sharded flat group per unit,
param group and dtype (each ``ShardedFlatGroup`` holding only its owned ``shard``
until gathered), the stage's hooks that call a unit's four moments
(``ZeRO3.unit_pre_forward`` calls ``unit.pre_forward()``, ``unit_post_forward``
``unit.post_forward(reshard)``, ``unit_pre_backward`` ``unit.pre_backward()``, and a
group's reduce-scatter, once its gradients are packed, ``unit.post_backward(group)``),
and the unit's all-gather: ``start_gather`` starts ``ZeRO3.all_gather`` -- one
``comm.all_gather`` per group -- on the communication thread, now or as a prefetch,
and leaves the work in ``self._gathering``.
Yours: the unit -- ``unshard`` and its four moments: when full parameters exist, and when they go.

Check it:   python -m minizero check zero3 --impl THIS_FILE
Besides equivalence, the checker counts the bytes -- two all-gathers and a
reduce-scatter, 3(N-1)/N x Psi x b, 1.5x DDP's (two-thirds of that without
resharding after forward) -- and the parameters each rank holds after a step:
1/N of them.
"""
from __future__ import annotations

from minizero.labs.given import Unit as GivenUnit
from minizero.labs.given import ZeRO3 as GivenZeRO3


class Unit(GivenUnit):
    def unshard(self, why: str) -> None:
        """Full parameters, now.  ``self.start_gather(why)`` starts the all-gather unless a prefetch already
        did (it does nothing if the unit is gathered); then, if ``self._gathering`` is not None, its
        ``.result()`` is a list of full flat buffers, one per group: point each group at its buffer with
        ``group.use(full)`` (for ``group, full in zip(self.groups, ...)``) and set ``self._gathering = None``."""
        raise NotImplementedError("write Unit.unshard: wait for the all-gather, use the full buffers")

    def pre_forward(self) -> None:
        """The unit is about to compute its forward: its parameters must be whole."""
        raise NotImplementedError("write Unit.pre_forward: the parameters whole before the unit computes")

    def post_forward(self, reshard: bool) -> None:
        """The unit's forward is done.  If ``reshard``, free its full parameters (``self.reshard()``): the
        backward will gather them again -- memory bought with a second all-gather."""
        raise NotImplementedError("write Unit.post_forward: free the full parameters if reshard")

    def pre_backward(self) -> None:
        """The unit's backward is about to run.  Autograd saved the *parameters*, not their values: make them
        whole again and backward computes with them."""
        raise NotImplementedError("write Unit.pre_backward: the parameters whole again for backward")

    def post_backward(self, group) -> None:
        """``group``'s gradients were packed for their reduce-scatter: its full parameters can go.  Free this
        group only (``self._free(group)``) -- the unit's other groups may still be computing."""
        raise NotImplementedError("write Unit.post_backward: free this group's full parameters")


class ZeRO3(GivenZeRO3):
    unit_class = Unit

"""A filled-in skeleton, written from its docstrings alone (tests/test_labs.py checks it passes).

Lab 7 -- ZeRO-3: gather a unit's parameters around its forward and backward, free them after (lessons/07_zero3.ipynb).

Given: the stage (``minizero.stages.ZeRO3``): one sharded flat group per unit,
param group and dtype (``self.groups``, each ``ShardedFlatGroup`` holding only
its owned ``shard`` until gathered), the hooks that call a unit's four moments,
prefetch (``start_gather``, which starts an all-gather on the communication thread
and leaves it in ``self._gathering``), and the gradients' reduce-scatter.
Yours: the unit's moments -- when full parameters exist, and when they go.

Check it:   python -m minizero check zero3 --impl THIS_FILE
Besides equivalence, the checker counts the bytes -- two all-gathers and a
reduce-scatter, 3(N-1)/N x Psi x b, 1.5x DDP's (two-thirds of that without
resharding after forward) -- and the parameters each rank holds after a step:
1/N of them.
"""
from __future__ import annotations

from minizero.stages import ZeRO3 as GivenZeRO3
from minizero.units import Unit as GivenUnit


class Unit(GivenUnit):
    def unshard(self, why: str) -> None:
        """Full parameters, now.  ``self.start_gather(why)`` starts the all-gather unless a prefetch already
        did (it does nothing if the unit is gathered); then, if ``self._gathering`` is not None, its
        ``.result()`` is a list of full flat buffers, one per group: point each group at its buffer with
        ``group.use(full)`` (for ``group, full in zip(self.groups, ...)``) and set ``self._gathering = None``."""
        self.start_gather(why)
        if self._gathering is not None:
            for group, full in zip(self.groups, self._gathering.result()):
                group.use(full)
            self._gathering = None

    def before_forward(self) -> None:
        """The unit is about to compute: its parameters must be whole."""
        self.unshard("forward")

    def after_forward(self, reshard: bool) -> None:
        """The unit's forward is done.  If ``reshard``, free its full parameters (``self.reshard()``): the
        backward will gather them again -- memory bought with a second all-gather."""
        if reshard:
            self.reshard()

    def before_backward(self) -> None:
        """The unit's backward is about to run.  Autograd saved the *parameters*, not their values: make them
        whole again and backward computes with them."""
        self.unshard("backward")

    def after_backward(self, group) -> None:
        """``group``'s gradients were packed for their reduce-scatter: its full parameters can go.  Free this
        group only (``self._free(group)``) -- the unit's other groups may still be computing."""
        self._free(group)


class ZeRO3(GivenZeRO3):
    unit_class = Unit

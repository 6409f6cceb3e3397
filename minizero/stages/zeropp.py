"""Stage ``zeropp``: ZeRO-3 with ZeRO++'s two changes to its weight gathers (Wang et al. 2023, arXiv:2306.10209).

ZeRO-3 (:mod:`.zero3`) all-gathers every unit twice a step, before its forward and again before its backward:
two thirds of its bytes, and on a cluster every one of them crosses the slow inter-node link.  ZeRO++ changes
only where and how those gathers travel; the step is ZeRO-3's, and so is everything else in this stage:

* **qwZ** (``quantized_weights="int8"`` or ``"int4"``, section 3.1): each rank's shard travels as block-quantized
  codes (:class:`~minizero.compress.weights.QuantizedWeights`), about a quarter of fp32's bytes at int8.  Every
  rank, the owner too, computes with the decoded weights; the optimizer steps the exact shards.  Training then
  takes its gradient at rounded weights: the suite compares with a reference that rounds the same way.
* **hpZ** (``hpz=True``, section 3.2): when a unit's forward gather completes, each rank keeps its ``1/G`` slice of
  the full weights (``G`` ranks per node, :class:`~minizero.parts.secondary.SecondaryShards`), so the backward
  gather runs inside the node -- a third of the step's inter-node bytes saved, for up to ``Psi/G`` more elements
  held between forward and backward.  torch's ``fully_shard(reshard_after_forward=G)`` is the same mechanism.

The third of ZeRO++'s changes, qgZ (int4 gradients through an all-to-all), is a wire: ``compress="int4"`` on any
ZeRO stage.  The two here are not built together: hpZ's slices would be of the decoded weights.
"""
from __future__ import annotations

import torch

from ..comm import Work
from ..comm.nodes import assumed_nodes
from ..compress.weights import QuantizedWeights, parse_weights
from ..costs.formulas import all_gather_bytes, reduce_scatter_bytes
from ..parts.precision import Precision
from ..parts.secondary import SecondaryShards
from ..parts.units import Unit
from . import facts
from .options import Option, weights_spec
from .zero3 import ZeRO3
from .zero_state import INSPECTION


class ZeROPlusPlus(ZeRO3):
    name = "zeropp"
    options = (*ZeRO3.options[:4],
               Option("quantized_weights", None, "all-gather the parameters as int8 or int4 codes (ZeRO++'s qwZ; "
                      "compute then sees the decoded weights)", weights_spec),
               # (not drawn by the whole suite, whose draws it would shift: tests/test_hsdp.py draws it in every example)
               Option("hpz", False, "keep a node-local slice of each unit gathered for forward, so the backward "
                      "all-gather stays inside the node (ZeRO++'s hpZ; on the network's nodes)", None),
               *ZeRO3.options[4:])

    def __init__(self, module, optimizer=None, comm=None, units=None, reshard_after_forward: bool = True,
                 prefetch: int = 1, replicate=None, quantized_weights: str | None = None, hpz: bool = False, **common):
        self.check_combination(quantized_weights=quantized_weights, hpz=hpz, precision=common.get("precision"))
        codec = parse_weights(quantized_weights)
        super().__init__(module, optimizer, comm, units=units, reshard_after_forward=reshard_after_forward,
                         prefetch=prefetch, replicate=replicate, **common)
        self.weight_wire = QuantizedWeights(self.shard_comm, codec) if codec is not None else None  # qwZ, or None
        self.secondary = SecondaryShards(comm, self._observe) if hpz else None  # hpZ, or None

    @classmethod
    def check_combination(cls, quantized_weights: str | None = None, hpz: bool = False, precision=None,
                          **others) -> None:
        codec = parse_weights(quantized_weights)
        if codec is not None and hpz:
            raise ValueError(f"hpz with quantized_weights={quantized_weights!r} is not built: the node-local slices "
                             f"would be of the decoded weights; use one or the other")
        if codec is not None and Precision.of(precision).mixed:
            raise ValueError(f"quantized_weights={quantized_weights!r} under mixed precision is not built: the working "
                             f"copy is already 16-bit; use precision='fp32'")
        super().check_combination(precision=precision, **others)

    def all_gather(self, unit: Unit, why: str) -> Work:
        """ZeRO-3's gather of ``unit``, travelling as ZeRO++ has it: a backward gather from the node's slices (hpZ),
        a training gather as codes (qwZ), a state dict's gather exact; a forward gather keeps the node's slice."""
        tag = self.tag(f"{unit.label} {why} all-gather")
        fulls = [g.full_buffer() for g in unit.groups]  # allocated here, on the main thread; written there
        if why == "forward" and self.secondary is not None:  # (and hpZ's slices of them)
            for group, full in zip(unit.groups, fulls, strict=True):
                self.secondary.reserve(group, full, unit.index)

        def all_gather() -> list[torch.Tensor]:
            for group, full in zip(unit.groups, fulls, strict=True):
                if why == "backward" and self.secondary is not None and self.secondary.holds(group):
                    self.secondary.all_gather(full, group, tag)  # hpZ: from the node's slices, inside the node
                elif self.weight_wire is None or why == INSPECTION:  # a state dict holds the weights, not codes
                    self.shard_comm.all_gather(full, group.shard, tag=tag)
                else:  # qwZ: codes travel, every rank computes with the decoded shards
                    self.weight_wire.all_gather(full, group.shard, tag)
                if why == "forward" and self.secondary is not None:
                    self.secondary.keep(group, full)
            return fulls
        return self.comm.submit(all_gather)

    def step(self) -> None:
        """ZeRO-3's step; the node's slices go first (inside the step: a refused step keeps them), as they hold the
        weights the step is about to change."""
        with self.stepping():
            for unit in self.units:
                unit.drop_prefetch()
            if self.secondary is not None:
                self.comm.submit(self.secondary.drop).wait()
            self.optimizer.step_owned()

    def held_tensors(self) -> dict[str, list[torch.Tensor]]:
        held = super().held_tensors()
        held["params"] += self.secondary.held() if self.secondary is not None else []
        return held

    def full_state_dict(self) -> dict:
        """ZeRO-3's, with units gathered for training as codes gathered again, exactly (an inspection: the gathered
        working set's observers hear none of it)."""
        if self.weight_wire is not None:
            observers, self._observers = self._observers, []
            try:
                for unit in self.units:
                    unit.drop_prefetch()
                    unit.reshard()
            finally:
                self._observers = observers
        return super().full_state_dict()

    # ------------------------------------------------------------------ facts
    @classmethod
    def sent_bytes_by_link(cls, psi, world_size, grad_bytes, param_bytes, nodes=None, hierarchical: bool = False,
                           reshard_after_forward: bool = True, quantized_weights: str | None = None, hpz: bool = False,
                           **options) -> dict[str, float]:
        """ZeRO-3's bytes, with the parameters travelling as the codec's messages (whole shards: the blocks of a
        shard of Psi/N elements), and hpZ's backward gather all inside the node, among its ``G`` ranks."""
        codec = parse_weights(quantized_weights)
        gathered = psi * param_bytes if codec is None or not param_bytes else \
            world_size * codec.message_bytes(-(-int(psi) // world_size), torch.float32)
        secondary = hpz and reshard_after_forward
        world = reduce_scatter_bytes(psi * grad_bytes, world_size) + \
            (1 if secondary or not reshard_after_forward else 2) * all_gather_bytes(gathered, world_size)
        split = facts.split_by_link(world, world_size, nodes, hierarchical)
        if secondary:
            split["intra"] += all_gather_bytes(psi * param_bytes, (nodes or assumed_nodes(world_size)).per_node)
        return split

    @classmethod
    def gather_span(cls, when: str, hpz: bool = False, **options) -> str:
        """hpZ's backward gathers run among the node's ranks."""
        return "node" if hpz and when == "backward" else cls.shard_span

"""What a lab's skeleton builds on: the package's class with the lab's answer taken out.

A skeleton that subclassed the finished stage would hand a learner the answer
for every method they deleted or left empty -- ``class DDP(GivenDDP): pass``
trained correctly and passed.  Here each method the lab asks for is replaced by
one that raises, naming it: what is given (wrapping, the layout, the hooks, the
optimizer) is the package's; what is the lesson's idea is the learner's, or
nothing.  The checker also verifies that the learner's file defines each method
and that a step calls it (:func:`minizero.course.labs.ranks.yours_run`), so a file that
imports the finished class instead is refused before any property.
"""
from __future__ import annotations

import types

import torch
import torch.distributed as dist

from ...comm import RingComm
from ...comm.hierarchical import HierarchicalComm
from ...compress import Wire as PackageWire
from ...parts.masters import MasterWeights as PackageMasterWeights
from ...parts.units import Unit as PackageUnit
from ...stages import DDP as PackageDDP
from ...stages import BucketedDDP as PackageBucketedDDP
from ...stages import LocalSGD as PackageLocalSGD
from ...stages import ZeRO1 as PackageZeRO1
from ...stages import ZeRO2 as PackageZeRO2
from ...stages import ZeRO3 as PackageZeRO3

#: The classes a lab's stage builds from one of its attributes -- the learner's only once their stage names it.
#: A step that runs the skeleton's or the base's copy of such a class's method, in a file that defines it, is told
#: which attribute to set (:func:`minizero.course.labs.ranks.yours_run`).
BUILT_AS = {"Unit": "ZeRO3.unit_class", "Wire": "DDP.wire_class", "MasterWeights": "ZeRO2.master_class",
            "PowerSGDWire": "BucketedDDP.wire_class"}


def set_yours(cls_name: str) -> str:
    """``"; set unit_class = Unit in your ZeRO3"``: how to make the stage build the learner's ``cls_name``."""
    if cls_name not in BUILT_AS:
        return ""
    stage, attribute = BUILT_AS[cls_name].split(".")
    return f"; set {attribute} = {cls_name} in your {stage} (the stage builds its {cls_name}s from it)"


def without(cls: type, *methods: str, name: str | None = None, delegates: dict | None = None, **given) -> type:
    """A subclass of ``cls`` whose ``methods`` raise ``NotImplementedError("write Class.method ...")``: what a
    learner's file runs for a method it does not write.  ``given``: class attributes set on it (the unit or wire
    class the stage builds, itself a base with the lab's methods taken out: :data:`BUILT_AS`).  ``delegates``:
    ``{method: (function, ...)}``, what the package's method hands all its work to -- the answer too."""
    shown = name or cls.__name__
    instead = f" -- or, if it does, the stage builds the lab's base {shown}, not yours{set_yours(shown)}" \
        if shown in BUILT_AS else ""

    def unwritten(method: str):
        def raises(self, *args, **kwargs):
            raise NotImplementedError(f"write {shown}.{method} (your file does not define it: the lab's base "
                                      f"leaves it to you{instead})")

        raises.__name__ = raises.__qualname__ = method
        raises.__doc__ = f"Yours to write: {shown}.{method} (see the lab's skeleton for what it must do)."
        return raises

    body = {method: unwritten(method) for method in methods}
    # The package's own methods taken out -- the answer key: a learner's method that calls one by name is refused
    # (:func:`minizero.course.labs.yours.answer_key`).
    body["__answers__"] = {method: getattr(cls, method) for method in methods}
    body["__delegates__"] = dict(delegates or {})
    body["__doc__"] = f"The package's {cls.__name__} without {', '.join(methods)}: the lab's part, left to you."
    body["__module__"] = __name__
    body.update(given)
    return type(shown, (cls,), body)


def _sizes_agreed_first(self, send, recv, part: str, step: int) -> None:
    """The ring's step, checked: first every rank's send and receive sizes are gathered, and a rank whose send is
    not the size its right neighbour receives into is named, on every rank -- gloo would abort the receiver
    ("Received data size doesn't match expected size"), or the ring would deadlock, with no word of which step or
    chunk.  Bookkeeping of the checker's, not the algorithm's: this gather is not in the ledger."""
    if self.check and self.world_size > 1:
        n = self.world_size
        mine = torch.tensor([0 if send is None else send.numel(), 0 if recv is None else recv.numel()])
        sizes = [torch.empty_like(mine) for _ in range(n)]
        dist.all_gather(sizes, mine, group=self.group)
        for k in range(n):
            sends, receives = int(sizes[k][0]), int(sizes[(k + 1) % n][1])
            if sends != receives:
                raise RuntimeError(f"rank {self.rank}: {part} step {step}: rank {k} sends {sends} elements and rank "
                                   f"{(k + 1) % n} receives into a chunk of {receives} -- each step's send must be "
                                   f"the chunk its right neighbour receives into")
    RingComm._send_right_recv_left(self, send, recv, part, step)


# One base per class a lab's methods are on (the lab catalogue names the methods: minizero.course.labs.catalogue).
Ring = without(RingComm, "_ring_reduce_scatter", "_ring_all_gather", name="Ring",
               _send_right_recv_left=_sizes_agreed_first)
DDP = without(PackageDDP, "post_backward")
BucketedDDP = without(PackageBucketedDDP, "post_accumulate_grad", "deferred_all_reduce")
Wire = without(PackageWire, "encode", "decode")


class CompressDDP(without(PackageDDP, "no_sync", name="DDP")):
    """DDP whose compressed wire is ``wire_class`` -- the learner's ``Wire`` once their DDP names it, as ZeRO-3 names
    its ``unit_class``."""

    wire_class = Wire

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        if self.wire is not None:
            self.wire = self.wire_class(self.comm, self.wire.wire_dtype)


CompressDDP.__name__ = CompressDDP.__qualname__ = "DDP"
ZeRO1 = without(PackageZeRO1, "post_backward", "all_gather_parameters")
ZeRO2 = without(PackageZeRO2, "post_accumulate_grad", "deferred_reduce_scatter", "post_backward")
Unit = without(PackageUnit, "unshard", "pre_forward", "post_forward", "pre_backward", "post_backward")
ZeRO3 = without(PackageZeRO3, unit_class=Unit)  # its methods are the package's; its units are the learner's


# Lab mixed-precision (lesson 10): the step through the fp32 masters is the learner's; the stage around it is ZeRO-2's,
# whose ranks each see only their shard of the averaged gradient -- an inf in one rank's gradient lands in one
# rank's shard, so only an overflow verdict agreed across ranks skips the step everywhere.
MasterWeights = without(PackageMasterWeights, "unscale_", "_agree_on_overflow", "step", "refresh")
MixedZeRO2 = without(PackageZeRO2, name="ZeRO2", master_class=MasterWeights,
                     __doc__="The package's ZeRO-2, whole: its masters are the learner's MasterWeights "
                             "(``master_class``), as ZeRO-3's units are its ``unit_class``.")
# Lab local-sgd (lesson 13): when to average, and the average itself (DiLoCo's outer step when outer_lr is given).
LocalSGD = without(PackageLocalSGD, "step", "average")
# Lab tree (lesson 2): the binomial tree's two phases; the all-reduce that calls them, and every other collective
# (the ring's), are given.
from ...comm.tree import TreeComm  # noqa: E402 -- appended with its lab

Tree = without(TreeComm, "_tree_reduce", "_tree_broadcast", name="Tree")
# Lab reshard (lesson 12): a rank's range of the flat layout at M, and its shards built from the N saved; the
# driver over the flat groups (reshard_all) is given.
from ...checkpoint.reshard import Reshard as PackageReshard  # noqa: E402 -- appended with its lab

Reshard = without(PackageReshard, "owned_range", "reshard")
# Lab powersgd (lesson 16): the PowerSGD step on one rank -- P = M Q, its all-reduce, orthogonalization, Q = M^T P,
# its all-reduce and mean, M = P Q^T; the wire around it (error feedback, warm start, the layout) is the package's.
from ...compress import PowerSGDWire as PackagePowerSGDWire  # noqa: E402 -- appended with its lab
from ...compress.powersgd import power_step as package_power_step  # noqa: E402

# (The package's method is one line: the module's power_step, which the same-steps reference runs too.)
PowerSGDWire = without(PackagePowerSGDWire, "power_step", delegates={"power_step": (package_power_step,)})


class PowerSGDBucketedDDP(PackageBucketedDDP):
    """The package's ddp-bucketed, whole, whose PowerSGD wire is ``wire_class`` -- the learner's ``PowerSGDWire``
    once their stage names it."""

    wire_class = PowerSGDWire

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        if isinstance(self.wire, PackagePowerSGDWire):
            self.wire = self.wire_class(self.comm, self.wire.settings, self.wire.error_feedback)


PowerSGDBucketedDDP.__name__ = PowerSGDBucketedDDP.__qualname__ = "BucketedDDP"


def _views_are_flat_rings(self, ranks):
    """:meth:`Comm.over`, and the view's all-reduce the flat ring's (an instance attribute: it wins over the
    learner's ``_all_reduce``, which the view's class -- the learner's -- defines), so ``self.across.all_reduce``
    inside the learner's method is the flat ring over those ranks (:mod:`minizero.course.labs.mistakes_hierarchical`)."""
    view = HierarchicalComm.over(self, ranks)
    view._all_reduce = types.MethodType(RingComm._all_reduce, view)
    return view


#: The hierarchical lab's base: the package's two-level Comm without its all-reduce.
Hierarchical = without(HierarchicalComm, "_all_reduce", name="Hierarchical", over=_views_are_flat_rings)

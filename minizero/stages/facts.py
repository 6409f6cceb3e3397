"""What a stage states about itself: what it shards, the bytes it sends and keeps, how it lays gradients out
for reduction, how the scaling model replays its step.

The functions below are :class:`~minizero.stages.base.Stage`'s class methods -- the reference's facts
(``cls`` is the stage class), written here so the stage's file reads as its lifecycle; each stage that
communicates states its own in its file."""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from ..parts.buckets import MiB
from ..parts.layout import plan_groups
from ..parts.precision import Precision


@dataclass(frozen=True)
class Shards:
    """What a stage divides among its N ranks -- the ZeRO paper's P_os, P_os+g, P_os+g+p (section 5)."""

    optimizer_states: bool = False
    gradients: bool = False
    parameters: bool = False


@dataclass(frozen=True)
class GradientMemory:
    """Where a stage's gradients live during a step: what :mod:`minizero.course.harness.backward_memory` walks through
    backward to predict the step's peak.

    ``kept``: their storage outlives ``zero_grad()`` -- buckets each ``.grad`` views (``ddp-bucketed``, torch DDP's
    ``gradient_as_bucket_view``), ZeRO-1's flat buffers -- so it is there when backward starts.  Otherwise
    ``zero_grad()`` frees them and each is born as backward reaches its parameter.
    ``buckets``: gradients packed bucket by bucket during backward, freed, and reduce-scattered to this rank's
    1/N, at most ``reduce_scatter_buffers`` in flight (:data:`~minizero.parts.buckets.MAX_IN_FLIGHT` unless set) --
    ``"bucket_mb"`` (ZeRO-2) or ``"unit"``
    (ZeRO-3: a unit's gradients are its bucket)."""

    kept: bool = False
    buckets: str | None = None


@dataclass(frozen=True)
class Reduction:
    """How a stage lays gradients out for reduction: the parameter names in each flat buffer, in the
    order they are reduced; ``padded``: each buffer is padded to a multiple of N and reduce-scattered;
    ``packs_unused``: a parameter without a gradient on any rank still has its (zero) slot in the buffer;
    ``shards``: how many shards a padded buffer is cut into, if not N (a parameter server's S); ``whole``:
    the buffers (by index) all-reduced as they are even so, neither padded nor cut (ZeRO-3's replicated
    modules); ``replicas``: for a reduction in two levels, the groups of ``shards`` consecutive ranks that each reduce
    exactly that way, whose results are then averaged across the groups, shard by shard (HSDP's nodes -- one node
    included: where a compressed wire rides); None for one level."""

    buffers: list[list[str]]
    padded: bool = False
    packs_unused: bool = True
    shards: int | None = None
    whole: frozenset = frozenset()
    replicas: int | None = None


def sent_bytes_per_step(cls, psi: int, world_size: int, grad_bytes: int, param_bytes: int, **options) -> float:
    """Bytes each rank sends per optimizer step (Psi parameters, b bytes per element on the wire)."""
    return 0.0


def busiest_sent_bytes_per_step(cls, psi: int, world_size: int, grad_bytes: int, param_bytes: int,
                                **options) -> float:
    """Bytes the busiest rank sends per step: every rank's share alike, but for a parameter server."""
    return cls.sent_bytes_per_step(psi, world_size, grad_bytes, param_bytes, **options)


def sent_bytes_by_link(cls, psi: int, world_size: int, grad_bytes: int, param_bytes: int, nodes=None,
                       hierarchical: bool = False, **options) -> dict[str, float] | None:
    """:meth:`sent_bytes_per_step` per link class on ``nodes`` (:class:`~minizero.comm.Nodes`), as the mean over
    ranks, for a stage whose collectives are rings.  A flat ring sends everything to the right neighbour, and
    only a node's last rank's neighbour is on another node: ``M/N`` of the bytes cross (none on one node).  In
    two levels (:mod:`minizero.comm.hierarchical`) a reduce-scatter, all-gather or all-reduce sends
    ``(G-1)/G`` of the tensor inside and ``(M-1)/(M G)`` across: ``(M-1)/(N-1)`` of its bytes cross."""
    return split_by_link(cls.sent_bytes_per_step(psi, world_size, grad_bytes, param_bytes, **options), world_size, nodes,
                         hierarchical)


def after_backward_elements(cls, psi: int, world_size: int, **options) -> float:
    """Elements of the buffers the collective after backward holds beside the gradients, for a moment -- none for a
    stage that reduces in place or during backward."""
    return 0.0


def split_by_link(total: float, world_size: int, nodes=None, hierarchical: bool = False) -> dict[str, float]:
    """``total`` bytes of ring collectives over all ranks, per link class (see :func:`sent_bytes_by_link`)."""
    m, n = (nodes.count, nodes.world_size) if nodes is not None else (1, world_size)
    across = 0.0 if m == 1 or n == 1 else (m - 1) / (n - 1) if hierarchical else m / n
    return {"intra": total * (1 - across), "inter": total * across}


def state_terms(cls, element_size: int, state_tensors: int, precision=None,
                offload_optimizer: bool = False) -> tuple[int, int]:
    """Model-state bytes per parameter on the device as ``(kept whole on every rank, divided by N)`` -- the
    ZeRO paper's Table 1 from :attr:`shards`.  Parameters and gradients take the working precision's bytes
    (2 under mixed precision); the optimizer's K bytes are its ``state_tensors`` states in ``element_size``
    (the model's precision), plus the fp32 master under mixed precision: Adam's K = 4 + 4 + 4 = 12.
    ``offload_optimizer``: the K bytes are in host memory (:meth:`host_state_bytes`), none on the device."""
    precision = Precision.of(precision)
    working = precision.working_bytes(element_size)
    k = 0 if offload_optimizer else optimizer_bytes(element_size, state_tensors, precision)
    kinds = [(working, cls.shards.parameters), (working, cls.shards.gradients), (k, cls.shards.optimizer_states)]
    return (sum(b for b, divided in kinds if not divided), sum(b for b, divided in kinds if divided))


def optimizer_bytes(element_size: int, state_tensors: int, precision=None, offloaded: bool = False) -> int:
    """K, the optimizer's bytes per parameter: its states, and the fp32 master under mixed precision -- or,
    offloaded in fp32, the shard's own host copy, which the host steps (:mod:`minizero.parts.offload`)."""
    return (element_size if Precision.of(precision).mixed or offloaded else 0) + state_tensors * element_size


def shard_count(cls, world_size: int, **options) -> int:
    """How many ranks divide what a stage shards: all N (HSDP: the G of a node)."""
    return world_size


def state_bytes(cls, psi: int, world_size: int, element_size: int, state_tensors: int, precision=None,
                offload_optimizer: bool = False, **options) -> float:
    """Model-state bytes per rank on the device (ZeRO paper, Table 1): Psi * (whole + divided / N), see
    :meth:`state_terms`."""
    whole, divided = cls.state_terms(element_size, state_tensors, precision, offload_optimizer)
    return psi * (whole + divided / cls.shard_count(world_size, **options))


def host_state_bytes(cls, psi: int, world_size: int, element_size: int, state_tensors: int, precision=None,
                     offload_optimizer: bool = False, **options) -> float:
    """Model-state bytes per rank in host memory: under offload the shard's K bytes per parameter (ZeRO-Offload:
    K Psi / N), nothing without it."""
    if not offload_optimizer:
        return 0.0
    k = optimizer_bytes(element_size, state_tensors, precision, offloaded=True)
    return psi * k / cls.shard_count(world_size, **options)


def state_formula(cls, element_size: int, state_tensors: int, precision=None, offload_optimizer: bool = False,
                  **options) -> str:
    """:meth:`state_bytes` in the paper's notation: ``16Ψ``, ``4Ψ + 12Ψ/N``, ``2Ψ + 14Ψ/N``, ``16Ψ/N``;
    offloaded, the device's and then the host's: ``2Ψ + 2Ψ/N, host 12Ψ/N``."""
    n = cls.shard_symbol
    whole, divided = cls.state_terms(element_size, state_tensors, precision, offload_optimizer)
    device = " + ".join([f"{whole}Ψ"] * bool(whole) + [f"{divided}Ψ/{n}"] * bool(divided)) or "0"
    if not offload_optimizer:
        return device
    return f"{device}, host {optimizer_bytes(element_size, state_tensors, precision, offloaded=True)}Ψ/{n}"


def schedule(cls, s, **options) -> None:
    """One step as the scaling model replays it (:class:`minizero.costs.cost_model.Schedule`): what computes,
    what communicates, and what waits for what.  Single-device training only computes."""
    s.forward()
    s.backward()
    s.optimizer_step()


def reduction(cls, model: nn.Module, optimizer: torch.optim.Optimizer, world_size: int, **options) -> Reduction:
    """How gradients are laid out for reduction; the reference reduces nothing."""
    return Reduction([])


def check_command_line(cls, world_size: int, steps: int, given: dict) -> None:
    """Refuse, in the command line's words and before any rank starts, options (``given`` by keyword) that this
    stage would refuse on every rank or silently ignore at this world size and number of steps.  Nothing to
    check for most stages; the parameter server and local SGD say theirs."""


def check_combination(cls, wire=None, precision=None, **others) -> None:
    """Options that cannot go together on this stage, decided from them alone (as its constructor takes them:
    ``wire=``, ``precision=`` policies or their specs).  The command line asks before any rank starts
    (:func:`~minizero.course.harness.preflight.check_design_options`); the constructor asks again on every rank,
    so a stage built in code says the same.  Here: the wire against the stage's collective and the precision."""
    from ..compress import WirePolicy, check_wire, parse
    policy = WirePolicy.of(wire)
    if parse(policy.compress) is not None and any(o.into is not None and o.into[0] == "wire" for o in cls.options):
        check_wire(policy, Precision.of(precision), cls.averages_with)  # (no wire: the command names its own flag)


def bucket_numel(bucket_mb: float, param_groups: list[dict], precision=None) -> int:
    """The bucket cap in elements, for the dtype gradients have: the first parameter's, or the working
    copy's under mixed precision (the buckets are built before the model is cast)."""
    element_size = Precision.of(precision).working_bytes(
        next((p.element_size() for g in param_groups for p in g["params"]), 4))
    return max(1, int(bucket_mb * MiB // element_size))


def reduction_in_buckets(cls, model: nn.Module, optimizer: torch.optim.Optimizer, world_size: int,
                         bucket_mb: float = 25.0, **options) -> Reduction:
    """ZeRO-1's and -2's flat groups: each param group's parameters (and dtype), cut at ``bucket_mb``."""
    names = {id(p): n for n, p in model.named_parameters()}
    cap = bucket_numel(bucket_mb, optimizer.param_groups, options.get("precision"))
    return Reduction([[names[id(p)] for p in params]
                      for _, params in plan_groups([g["params"] for g in optimizer.param_groups], cap)], padded=True)

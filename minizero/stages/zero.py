"""What ZeRO-1, -2 and -3 share (ZeRO paper, section 5): parameters laid out flat and sharded, and the user's
optimizer stepping only this rank's shard.

Each ZeRO stage derives from :class:`ZeRO` alone and reads top to bottom: wrap (check, broadcast), lay out its flat
groups (:mod:`minizero.parts.layout`), :meth:`ZeRO.shard` them, then its own hooks with its own collectives --
reduce-scatter gradients (when, and in what buckets, tells the stages apart), step the owned shard, all-gather.
What they share is here:

* the **pieces**: every parameter is visible as this rank's piece of it, a 1-D view into the owned shard (possibly
  empty), whose ``.grad`` is the matching piece of the averaged gradient -- FSDP's ``use_orig_params``;
* the **sharded optimizer** (:class:`~minizero.parts.sharded_optimizer.ShardedOptimizer`) when the stage is given
  the user's optimizer at wrap time; an optimizer built after wrapping over ``stage.parameters()`` steps the pieces;
* torch's ``.grad`` semantics on the pieces: a reduced gradient is *added* to an existing ``.grad`` or becomes it;
  a parameter without a gradient anywhere keeps ``.grad = None`` and is not stepped.
"""
from __future__ import annotations

import torch
from torch import nn

from ..comm import Comm
from ..compress import WirePolicy, make_wire, overflow
from ..parts.grad_buffers import FullGradients
from ..parts.layout import FlatGroup
from ..parts.offload import HostCopies, OffloadPolicy
from ..parts.precision import Precision
from ..parts.sharded_optimizer import ShardedOptimizer, check_shardable
from . import clip, facts, hooks, mixed, sharing, unused, zero_state
from .base import Stage
from .unused import unused_error
from .wrap import broadcast_module, check_optimizer_owns_only_model_parameters, check_same_model


class ZeRO(Stage):
    shards = None  # each ZeRO stage states its own
    averages_with = "reduce_scatter"  # the collective its gradients are averaged with: the wires it fits

    def __init__(self, module: nn.Module, optimizer: torch.optim.Optimizer | None, comm: Comm,
                 *, wire: WirePolicy | str = WirePolicy(), find_unused_parameters: bool = False,
                 precision: Precision | str = "fp32", offload: OffloadPolicy | bool = OffloadPolicy()):
        rank = comm.rank if comm else 0
        if optimizer is not None:  # before anything is changed: a refused wrap leaves the optimizer as it was
            check_shardable(type(optimizer), rank)
        wire, offload = WirePolicy.of(wire, rank), OffloadPolicy.of(offload, rank)
        super().__init__(module, optimizer, comm, precision)
        # ZeRO-Offload (minizero.parts.offload): the owned shard's masters and optimizer states in host memory.
        self.host_copies = HostCopies() if offload.optimizer else None
        # The ranks the parameters are sharded over, and those each shard is replicated over (None: sharded
        # over every rank).  ZeRO shards over all N; HSDP over a node, replicated across nodes.
        self.shard_comm, self.replica_comm = self.mesh(comm)
        self.find_unused_parameters = find_unused_parameters
        if optimizer is not None:
            check_optimizer_owns_only_model_parameters(optimizer, module, self.rank)
        # The wire rides the collective the stage averages with -- HSDP's: the all-reduce across its replicas
        self.wire = make_wire(self.replica_comm or comm, wire, self.trainable(), self.precision,
                              averages_with=self.averages_with)
        self.deferring = overflow.defer([self.wire])  # each rank decodes its shard of the sum: an inf is agreed on
        check_same_model(module, comm)
        broadcast_module(module, comm)
        self.user_optimizer = optimizer
        self.groups: list[FlatGroup] = []
        self._shared_versions: list[int] = []  # each group's version counter when last all-gathered
        self._unshared: set[int] = set()  # parameters with a gradient since the last all-gather (stepped, not shared)
        self._nothing: dict[str, nn.Parameter] = {}  # the empty pieces of parameters this rank owns none of
        self._synchronised_at_share = 0  # self.synchronised when the full parameters were last made current
        self.full_grads: FullGradients | None = None  # ZeRO-1's (and ps's) full gradient buffers; None for ZeRO-2/3

    def mesh(self, comm: Comm) -> tuple[Comm, Comm | None]:
        """``(shard over, replicate over)``: every rank shards, nothing is replicated (a 1-D mesh)."""
        return comm, None

    def param_groups(self) -> list[dict]:
        """What the flat groups are built from: the user's optimizer's param groups, or all trainable
        parameters as one group when the optimizer comes after wrapping."""
        if self.user_optimizer is not None:
            return self.user_optimizer.param_groups
        return [{"params": [p for _, p in self.trainable()]}]

    def names(self) -> dict[int, str]:
        return {id(p): n for n, p in self.module.named_parameters()}

    def shard(self, groups: list[FlatGroup]) -> None:
        """Take ``groups`` as this stage's layout; the user's optimizer, if given, becomes its sharded twin
        (routed: whichever ``step`` the user calls, the stage's runs -- it shares the result too)."""
        self.groups = groups
        if self.precision.mixed or self.host_copies:
            mixed.keep_sharded_masters(self)
        if not self.shards.parameters:  # full parameters kept: the all-gather after a step keeps them current
            self.remember_shared()
        if self.user_optimizer is not None:
            self.optimizer = ShardedOptimizer.from_optimizer(self.user_optimizer, groups, self.shard_comm, self.master)
            self.optimizer.step, self.optimizer.zero_grad = self.step, self.zero_grad

    hook_grouped_parameters = hooks.hook_grouped_parameters

    # ------------------------------------------------------------ the pieces
    named_parameters = zero_state.named_parameters  # the pieces, under the parameters' names

    def pieces(self):
        return [piece for group in self.groups for piece in group.pieces]

    def accumulate(self, group: FlatGroup, averaged: torch.Tensor, used: set[int]) -> None:
        """Give each piece of ``group`` its range of the averaged shard, as autograd gives ``.grad``: added to
        what is there, or as the new ``.grad``.  A parameter unused everywhere gets nothing (stays None)."""
        for piece in group.pieces:
            if id(piece.segment.param) in used:
                grad = averaged[piece.offset:piece.offset + piece.stop - piece.start]
                piece.param.grad = grad if piece.param.grad is None else piece.param.grad.add_(grad)

    # ------------------------------------------------------------ which parameters have a gradient
    def refuse_unused_here(self, groups: list[FlatGroup]) -> None:
        """Without find_unused_parameters, every parameter must have a gradient on every rank (no communication)."""
        if not self.find_unused_parameters:
            missing = [s.name for g in groups for s in g.segments if id(s.param) not in self._used]
            if missing:
                raise unused_error(self.rank, missing, "ZeRO steps the parameters that have one on every rank")

    used_after_backward = unused.used_after_backward

    def agree_on_overflow(self) -> None:
        """Each rank decoded only its shard of the sum: every rank refuses an inf or NaN together."""
        if any(wire.overflow_raises for wire in self.deferring):
            overflow.agree_on_overflow(self.comm, self.deferring, self.tag("overflow flag"))

    # ------------------------------------------------------------ after the step (minizero.stages.sharing)
    stepped_groups = sharing.stepped_groups
    remember_shared = sharing.remember_shared
    stepped_outside = sharing.stepped_outside
    _version_of = staticmethod(sharing.version_of)

    def forget_gradients(self, set_to_none: bool) -> None:
        """As every stage's, but what had a gradient stays to be shared until the next all-gather."""
        self._unshared |= self._has_grad
        super().forget_gradients(set_to_none)

    def gather(self, full: torch.Tensor, shard: torch.Tensor, tag) -> None:
        """Every rank's ``full`` from the owners' shards, outside the training step (a consolidated state
        dict): an all-gather over the ranks that shard -- a parameter server pulls instead."""
        self.shard_comm.all_gather(full, shard, tag=tag)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """The pieces' gradients cleared (or zeroed); ZeRO-1's full buffers zeroed, ZeRO-2/3's leftover ones cleared."""
        self.forget_gradients(set_to_none)
        for piece in self.pieces():
            if set_to_none:
                piece.param.grad = None
            elif piece.param.grad is not None:
                piece.param.grad.zero_()
        if self.full_grads is not None:  # ZeRO-1's buffers zeroed, every .grad a view into them again
            self.full_grads.zero()
        else:  # ZeRO-2's and -3's full gradients, left by no_sync() micro-batches
            for s in (s for group in self.groups for s in group.segments):
                s.param.grad = None

    clip_grad_norm_ = clip.clip_pieces_grad_norm_

    # ------------------------------------------------------------ state dicts and accounting (minizero.stages.zero_state)
    held_tensors = zero_state.held_tensors
    full_gradients = zero_state.full_gradients
    full_state_dict = zero_state.full_state_dict
    full_optimizer_state_dict = zero_state.full_optimizer_state_dict
    shard_optimizer_state_dict = zero_state.shard_optimizer_state_dict
    sharded_names = zero_state.sharded_names
    owned_parts = zero_state.owned_parts
    load_full_state_dict = zero_state.load_full_state_dict
    load_full_optimizer_state_dict = zero_state.load_full_optimizer_state_dict
    _master_values = zero_state.master_values
    _full_shape = zero_state.full_shape

    reduction = classmethod(facts.reduction_in_buckets)  # ZeRO-1's and -2's flat groups (ZeRO-3 has its own)

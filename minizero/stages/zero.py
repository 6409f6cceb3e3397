"""What ZeRO-1, -2 and -3 share (ZeRO paper, section 5): parameters laid out flat and sharded, and
the user's optimizer stepping only this rank's shard.

Each ZeRO stage derives from :class:`ZeRO` alone and reads top to bottom:
wrap (check, broadcast), lay out its flat groups (:mod:`minizero.parts.layout`),
:meth:`ZeRO.shard` them, then its own hooks with its own collectives --
reduce-scatter gradients (when, and in what buckets, is what tells the stages
apart), step the owned shard, all-gather parameters.  What they share is here:

* the **pieces**: every parameter is visible as this rank's piece of it, a
  1-D view into the owned shard (possibly empty), whose ``.grad`` is the
  matching piece of the averaged gradient -- what FSDP's ``use_orig_params``
  offers.  ``stage.parameters()`` yields them, so an optimizer built *after*
  wrapping -- ``torch.optim.AdamW(stage.parameters(), lr=...)``, as torch's
  FSDP2 documentation writes it -- steps exactly the owned shard;
* the **sharded optimizer** (:class:`~minizero.parts.sharded_optimizer.ShardedOptimizer`)
  when the stage is given the user's optimizer at wrap time -- with any state it
  already holds (a consolidated checkpoint loaded into it), each rank keeping
  its pieces' range of it (:mod:`minizero.parts.kept_state`);
* torch's ``.grad`` semantics on the pieces: a reduced gradient is *added* to
  an existing ``.grad`` (accumulation across backward passes, as in torch) or
  becomes it; a parameter without a gradient anywhere keeps ``.grad = None``
  and is not stepped;
* global-norm clipping over the pieces, and full and sharded state dicts.
"""
from __future__ import annotations

import functools

import torch
from torch import nn

from ..comm import Comm, ReduceOp
from ..compress import make_wire
from ..parts.layout import FlatGroup
from ..parts.offload import HOST_KIND, HostCopies, check_offloadable
from ..parts.part import Part, flat_range
from ..parts.precision import Precision, cast_parameters
from ..parts.sharded_optimizer import ShardedOptimizer, check_shardable, clip_sharded_grad_norm_
from .base import Stage, unused_error
from .state import optimizer_tensors
from .wrap import broadcast_module, check_same_model


class ZeRO(Stage):
    shards = None  # each ZeRO stage states its own
    averages_with = "reduce_scatter"  # the collective its gradients are averaged with: the wires it fits

    def __init__(self, module: nn.Module, optimizer: torch.optim.Optimizer | None, comm: Comm,
                 compress: str | None = None, error_feedback: bool = False, find_unused_parameters: bool = False,
                 precision: str | Precision = "fp32", offload_optimizer: bool = False):
        if optimizer is not None:  # before anything is changed: a refused wrap leaves the optimizer as it was
            check_shardable(type(optimizer), comm.rank if comm else 0)
        check_offloadable(offload_optimizer, comm.rank if comm else 0)
        super().__init__(module, optimizer, comm, precision)
        # ZeRO-Offload (minizero.parts.offload): the owned shard's masters and optimizer states in host memory.
        self.host_copies = HostCopies() if offload_optimizer else None
        # The ranks the parameters are sharded over, and those each shard is replicated over (None: sharded
        # over every rank).  ZeRO shards over all N; HSDP over a node, replicated across nodes.
        self.shard_comm, self.replica_comm = self.mesh(comm)
        self.find_unused_parameters = find_unused_parameters
        if optimizer is not None:
            check_optimizer_owns_only_model_parameters(optimizer, module, self.rank)
        # The wire rides the collective the stage averages with -- HSDP's: the all-reduce across its replicas
        self.wire = make_wire(self.replica_comm or comm, compress, error_feedback, self.trainable(), self.precision,
                              averages_with=self.averages_with)
        check_same_model(module, comm)
        broadcast_module(module, comm)
        self.user_optimizer = optimizer
        self.groups: list[FlatGroup] = []
        self._shared_versions: list[int] = []  # each group's version counter when last all-gathered
        self._unshared: set[int] = set()  # parameters with a gradient since the last all-gather (stepped, not shared)
        self._nothing: dict[str, nn.Parameter] = {}  # the empty pieces of parameters this rank owns none of
        self._synchronised_at_share = 0  # self.synchronised when the full parameters were last made current

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
            self._keep_sharded_masters()
        if not self.shards.parameters:  # full parameters kept: the all-gather after a step keeps them current
            self.remember_shared()
        if self.user_optimizer is not None:
            self.optimizer = ShardedOptimizer.from_optimizer(self.user_optimizer, groups, self.shard_comm, self.master)
            self.optimizer.step, self.optimizer.zero_grad = self.step, self.zero_grad

    def _keep_sharded_masters(self) -> None:
        """Mixed precision, ZeRO's way: fp32 masters of the *owned shard* only (12 bytes per parameter for
        Adam, divided by N); the flat buffers -- parameters and what is all-gathered -- become 16-bit.
        Offloaded, the masters are kept in host memory -- in fp32 training too, as plain copies of the shard --
        and the optimizer, built over them, keeps its states there and steps there."""
        dtype = self.precision.working_dtype  # None in fp32: each group keeps its own
        place = {"place": self.host_copies.place} if self.host_copies else {}
        masters = [group.keep_master(dtype or group.dtype, **place) for group in self.groups]
        if dtype is not None:
            self._frozen = cast_parameters(self.module, dtype, skip={id(s.param) for g in self.groups for s in g.segments})
        working = [piece.param for group in self.groups for piece in group.pieces]
        pieces = [nn.Parameter(master[piece.offset:piece.offset + piece.stop - piece.start])
                  for group, master in zip(self.groups, masters, strict=True) for piece in group.pieces]
        copies = {"copies": self.host_copies} if self.host_copies else {}  # (a lab's own class need not take it)
        self.master = self.master_class(working, pieces, self.precision, self.comm, self.tag,
                                         masters[0].dtype if masters else None, optimizer_outside=self.user_optimizer is None,
                                         **copies)
        self._settle_wire()

    def _master_values(self) -> dict[int, torch.Tensor]:
        """Every parameter's whole fp32 master: each group's master shards all-gathered."""
        values = {}
        for g, group in enumerate(self.groups):
            full = group.master if group.replicated else group.master.new_empty(group.shard_size * group.world_size)
            if not group.replicated:
                self.gather(full, group.master, tag=self.tag(f"group {g} masters"))
            for segment, value in zip(group.segments, group.unpack_full(full), strict=True):
                values[id(segment.param)] = value
        return values

    # ------------------------------------------------------------ the pieces
    def pieces(self):
        return [piece for group in self.groups for piece in group.pieces]

    def named_parameters(self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True):
        """This rank's piece of every parameter, under the parameter's name (FSDP's ``use_orig_params``) --
        under mixed precision, the piece's fp32 master (FSDP2's sharded fp32 parameter).  A parameter this rank
        owns none of is an empty tensor, as a DTensor's local shard is: an optimizer built over the pieces is
        never empty, however small the model and many the ranks."""
        outside = self.masters_outside
        owned = {id(piece.segment): piece for piece in self.pieces()}
        for group in self.groups:
            for segment in group.segments:
                piece = owned.get(id(segment))
                if piece is None:
                    yield prefix + segment.name, self._nothing.setdefault(segment.name, nn.Parameter(
                        group.shard.new_empty(0, dtype=group.optimizer_dtype)))
                else:
                    yield prefix + segment.name, self.master.master_of(piece.param) if outside else piece.param

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

    def used_after_backward(self) -> set[int]:
        """After a backward whose gradients stay full until the end (ZeRO-1, the parameter server): every
        parameter has one here -- or, with ``find_unused_parameters``, the ranks agree on which have one anywhere."""
        try:
            self.refuse_unused_here(self.groups)
            return self.used_anywhere([s.param for g in self.groups for s in g.segments])
        finally:
            self._used.clear()

    # ------------------------------------------------------------ after the step
    def stepped_groups(self):
        """``(index, group)`` of the flat groups the last step changed: those with a gradient anywhere since the
        last all-gather -- the ones whose updated shards must be shared (a group no rank had a gradient for did not
        move).  Since the last all-gather, not since the last ``zero_grad()``: with the optimizer outside the stage,
        a loop's ``model.zero_grad()`` comes between its ``optimizer.step()`` and the next forward, which shares."""
        stepped = self._has_grad | self._unshared
        return [(g, group) for g, group in enumerate(self.groups)
                if any(id(s.param) in stepped for s in group.segments)]

    def forget_gradients(self, set_to_none: bool) -> None:
        """As every stage's, but what had a gradient stays to be shared until the next all-gather."""
        self._unshared |= self._has_grad
        super().forget_gradients(set_to_none)

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

    @staticmethod
    def _version_of(group) -> int:
        """What an in-place step of the owned shard bumps: the full buffer's version (the shard views it)."""
        return group.data._version

    def gather(self, full: torch.Tensor, shard: torch.Tensor, tag) -> None:
        """Every rank's ``full`` from the owners' shards, outside the training step (a consolidated state
        dict): an all-gather over the ranks that shard -- a parameter server pulls instead."""
        self.shard_comm.all_gather(full, shard, tag=tag)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """The pieces' gradients -- what the sharded optimizer steps -- cleared (or zeroed)."""
        self.forget_gradients(set_to_none)
        for piece in self.pieces():
            if set_to_none:
                piece.param.grad = None
            elif piece.param.grad is not None:
                piece.param.grad.zero_()

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Global-norm clipping over the pieces: each rank holds disjoint pieces of the averaged gradient."""
        # Mixed precision: the masters' unscaled fp32 gradients, as after GradScaler.unscale_.
        clipped = self.master.unscaled_masters() if self.master else [piece.param for piece in self.pieces()]
        replicated = [group.replicated for group in self.groups for _ in group.pieces]
        counted = [p.grad for p, r in zip(clipped, replicated, strict=True) if p.grad is not None and not r]
        replicas = [p.grad for p, r in zip(clipped, replicated, strict=True) if p.grad is not None and r]
        # The norm's dtype and device: the same on every rank, including one that owns no piece.
        dtype = functools.reduce(torch.promote_types, [g.optimizer_dtype for g in self.groups], torch.float32)
        device = self.groups[0].shard.device if self.groups else torch.device("cpu")
        # Summed over the ranks that shard (each holds disjoint pieces; a replica of a shard holds the same ones).
        first = self.shard_comm.rank == 0
        return clip_sharded_grad_norm_(counted + (replicas if first else []), max_norm, norm_type, self.shard_comm,
                                       dtype, device, self.tag("clip norm"), [] if first else replicas)

    def full_gradients(self) -> dict[str, torch.Tensor | None]:
        """Every parameter's averaged gradient in its full shape -- FSDP2's ``param.grad.full_tensor()`` --
        from every rank's pieces; None where no rank holds one.  A collective: every rank calls it, and gets
        all of them (the pieces' dtype; under mixed precision with the optimizer built after wrapping, the
        fp32 masters' gradients, which that optimizer steps)."""
        outside = self.masters_outside
        gradients = {}
        for g, group in enumerate(self.groups):
            dtype = group.optimizer_dtype if outside else group.dtype
            mine = torch.zeros(group.shard.numel(), dtype=dtype, device=group.shard.device)  # a worker's: empty
            held = torch.zeros(len(group.segments), device=group.shard.device)
            position = {id(s): i for i, s in enumerate(group.segments)}
            for piece in group.pieces:
                grad = (self.master.master_of(piece.param) if outside else piece.param).grad
                if grad is not None:
                    mine[piece.offset:piece.offset + piece.stop - piece.start] = grad
                    held[position[id(piece.segment)]] = 1.0
            full = mine if group.replicated else mine.new_empty(group.shard_size * group.world_size)
            if not group.replicated:
                self.gather(full, mine, tag=self.tag(f"group {g} full gradients"))
            self.comm.all_reduce(held, ReduceOp.MAX, tag=self.tag(f"group {g} which have a gradient"))
            for segment, value, anywhere in zip(group.segments, group.unpack_full(full), held.tolist(), strict=True):
                gradients[segment.name] = value if anywhere else None
        return gradients

    # ------------------------------------------------------------ accounting and state dicts
    def held_tensors(self) -> dict[str, list[torch.Tensor]]:
        # Storage is what counts: a view counts its whole buffer once (minizero.observe.memory).
        pieces = [piece.param.grad for piece in self.pieces() if piece.param.grad is not None]
        where = HOST_KIND if self.host_copies else ""  # offloaded: in host memory, counted apart
        return {"params": [p for _, p in self.trainable()],
                "grads": pieces + [p.grad for _, p in self.trainable() if p.grad is not None],
                where + "master": [group.master for group in self.groups if group.master is not None],
                where + "optimizer": optimizer_tensors(self.optimizer.local if self.optimizer is not None else None),
                "error_feedback": self.wire.held() if self.wire else []}

    def full_optimizer_state_dict(self) -> dict:
        """The state_dict a plain torch optimizer over the unwrapped model would have; every rank
        gets it, so it loads into ``type(optimizer)(model.parameters(), ...)``."""
        return self._require_optimizer("full_optimizer_state_dict").full_state_dict()

    def shard_optimizer_state_dict(self) -> dict:
        """This rank's local optimizer's state_dict, over its pieces (ZeroRedundancyOptimizer's local state);
        a checkpoint stores :meth:`owned_parts`, which any stage at any N can read."""
        return self._require_optimizer("shard_optimizer_state_dict").state_dict()

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """The shards stepped outside the stage are shared at the next forward; a state dict read before it reads
        them without sharing them.  A state dict observes: sharing here -- as it once did -- hid a stage that never
        shared (the experiments read one after every step)."""
        state = super().full_state_dict()
        if not self.stepped_outside() or self.master is not None:  # (the masters are read whole already)
            return state
        values = {}
        for g, group in enumerate(self.groups):
            full = group.data.new_empty(group.shard_size * group.world_size)
            self.gather(full, group.shard.detach().clone(), tag=self.tag(f"group {g} parameters, read"))
            values.update({id(s.param): v for s, v in zip(group.segments, group.unpack_full(full), strict=True)})
        for name, p in self.module.named_parameters(remove_duplicate=False):
            state[name] = values.get(id(p), state[name])
        return state

    # ------------------------------------------------------------ checkpoints
    def sharded_names(self) -> list[str]:
        return [s.name for group in self.groups for s in group.segments]

    def _full_shape(self, tensor: torch.Tensor) -> tuple[list[int], str]:
        """A grouped parameter's shape is its segment's (ZeRO-3's parameter is an empty placeholder), its
        dtype what the optimizer steps (the fp32 master under mixed precision)."""
        for group in self.groups:
            for s in group.segments:
                if s.param is tensor:
                    return list(s.shape), str(group.optimizer_dtype)
        return super()._full_shape(tensor)

    def owned_parts(self) -> list[Part]:
        """This rank's pieces, each a range of one parameter: its value (fp32 master under mixed precision)
        and the sharded optimizer's state for it -- what a sharded checkpoint stores, with no communication."""
        optimizer = self._require_optimizer("owned_parts")
        if self.replica_comm is not None and self.replica_comm.rank != 0:
            return []  # HSDP: the first replica of each shard writes it; the others hold the same values
        return [Part(piece.segment.name, piece.start, piece.stop, optimizer.stepped(piece).detach().clone(),
                     flat_range(optimizer.local.state.get(optimizer.stepped(piece)), 0, piece.stop - piece.start))
                for group in self.groups if not group.replicated or self.rank == 0  # a replica: rank 0 writes it
                for piece in group.pieces]

    def load_full_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Each group takes its flat values (fp32 masters under mixed precision; the buffer their cast);
        ZeRO-1/2 keep them whole, ZeRO-3 only its shard.  Buffers and frozen parameters load as they are."""
        grouped = set(self.sharded_names())
        self._load_module_tensors(state, skip=grouped)
        for group in self.groups:
            group.load_full(group.flatten([state[s.name] for s in group.segments], group.optimizer_dtype))
        if not self.shards.parameters:  # loading is not a step: nothing to all-gather before the next forward
            self.remember_shared()

    def load_full_optimizer_state_dict(self, saved: dict) -> None:
        self._require_optimizer("load_full_optimizer_state_dict").load_full_state_dict(saved)


def check_optimizer_owns_only_model_parameters(optimizer: torch.optim.Optimizer, module: nn.Module, rank: int) -> None:
    """A parameter the optimizer holds but the model does not gets no gradient and no name: refuse it here."""
    in_model = {id(p) for p in module.parameters()}
    foreign = [(gi, tuple(p.shape)) for gi, g in enumerate(optimizer.param_groups) for p in g["params"]
               if id(p) not in in_model]
    if foreign:
        raise ValueError(
            f"rank {rank}: the optimizer holds {len(foreign)} tensor(s) that are not parameters of the model "
            f"(param group, shape: {foreign[:3]}); ZeRO shards the model's parameters. Build the optimizer "
            f"over model.parameters() -- after any change to the model -- or after wrapping, over "
            f"stage.parameters().")

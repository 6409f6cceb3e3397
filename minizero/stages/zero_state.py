"""ZeRO's state, out and in, and what it holds: the accounting and state dicts of :class:`~minizero.stages.zero.ZeRO`.

Methods of the ZeRO family (``self`` is the stage: its flat ``groups`` and their ``pieces``, its sharded
``optimizer``, ``master`` under mixed precision), written here so that :mod:`minizero.stages.zero` reads as what
a ZeRO step runs -- as :mod:`minizero.stages.state` holds the single-device stage's.  None of it runs in a
training step: a state dict, a checkpoint's parts, the memory a stage holds, a full gradient for inspection, the
pieces as ``stage.parameters()`` for an optimizer built after wrapping.
"""
from __future__ import annotations

import torch
from torch import nn

from ..comm import ReduceOp
from ..parts.offload import HOST_KIND
from ..parts.part import Part, flat_range
from . import state as state_module
from .state import optimizer_tensors

#: What autograd wrote: a ZeRO-3 parameter's ``.grad`` may read as its sharded gradient after backward
#: (:mod:`minizero.stages.sharded_gradient`), which holds no memory of its own -- its pieces are counted.
_REAL_GRAD = torch.Tensor.grad
INSPECTION = "state_dict"  # why a ZeRO-3 unit is gathered outside training: exactly, whatever the training gathers send


def master_values(self) -> dict[int, torch.Tensor]:
    """Every parameter's whole fp32 master: each group's master shards all-gathered."""
    values = {}
    for g, group in enumerate(self.groups):
        full = group.master if group.replicated else group.master.new_empty(group.shard_size * group.world_size)
        if not group.replicated:
            self.gather(full, group.master, tag=self.tag(f"group {g} masters"))
        for segment, value in zip(group.segments, group.unpack_full(full), strict=True):
            values[id(segment.param)] = value
    return values


def full_gradients(self) -> dict[str, torch.Tensor | None]:
    """Every parameter's averaged gradient in its full shape -- FSDP2's ``param.grad.full_tensor()`` --
    from every rank's pieces; None where no rank holds one.  A collective: every rank calls it, and gets
    all of them (the pieces' dtype; under mixed precision with the optimizer built after wrapping, the
    fp32 masters' gradients, which that optimizer steps)."""
    return {name: value for g in range(len(self.groups)) for name, value in group_full_gradients(self, g).items()}


def piece_gradient(self, piece) -> torch.Tensor | None:
    """A piece's averaged gradient: its own ``.grad``, or under mixed precision with the optimizer built after
    wrapping, its fp32 master's (what that optimizer steps)."""
    return (self.master.master_of(piece.param) if self.masters_outside else piece.param).grad


def group_full_gradients(self, g: int) -> dict[str, torch.Tensor | None]:
    """:meth:`full_gradients` of flat group ``g`` alone (a collective over its ranks, and every rank's flags)."""
    group = self.groups[g]
    dtype = group.optimizer_dtype if self.masters_outside else group.dtype
    mine = torch.zeros(group.shard.numel(), dtype=dtype, device=group.shard.device)  # a worker's: empty
    held = torch.zeros(len(group.segments), device=group.shard.device)
    position = {id(s): i for i, s in enumerate(group.segments)}
    for piece in group.pieces:
        grad = piece_gradient(self, piece)
        if grad is not None:
            mine[piece.offset:piece.offset + piece.stop - piece.start] = grad
            held[position[id(piece.segment)]] = 1.0
    full = mine if group.replicated else mine.new_empty(group.shard_size * group.world_size)
    if not group.replicated:
        self.gather(full, mine, tag=self.tag(f"group {g} full gradients"))
    self.comm.all_reduce(held, ReduceOp.MAX, tag=self.tag(f"group {g} which have a gradient"))
    return {segment.name: value if anywhere else None
            for segment, value, anywhere in zip(group.segments, group.unpack_full(full), held.tolist(), strict=True)}


def held_tensors(self) -> dict[str, list[torch.Tensor]]:
    # Storage is what counts: a view counts its whole buffer once (minizero.observe.memory).
    pieces = [piece.param.grad for piece in self.pieces() if piece.param.grad is not None]
    where = HOST_KIND if self.host_copies else ""  # offloaded: in host memory, counted apart
    return {"params": [p for _, p in self.trainable()],
            "grads": pieces + [g for _, p in self.trainable() if (g := _REAL_GRAD.__get__(p)) is not None]
            + (self.full_grads.buffers if self.full_grads is not None else []),
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
    state = state_module.full_state_dict(self)
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

def sharded_names(self) -> list[str]:
    return [s.name for group in self.groups for s in group.segments]

def full_shape(self, tensor: torch.Tensor) -> tuple[list[int], str]:
    """A grouped parameter's shape is its segment's (ZeRO-3's parameter is an empty placeholder), its
    dtype what the optimizer steps (the fp32 master under mixed precision)."""
    for group in self.groups:
        for s in group.segments:
            if s.param is tensor:
                return list(s.shape), str(group.optimizer_dtype)
    return state_module.full_shape(self, tensor)

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


def held_tensors_gathered(self) -> dict[str, list[torch.Tensor]]:
    """ZeRO-3's: the parameters held are the owned shards, and the full buffers of units gathered right now."""
    held = held_tensors(self)
    held["params"] = [g.shard for g in self.groups] + [g.data for g in self.groups if g.gathered]
    return held


def full_state_dict_of_units(self) -> dict:
    """ZeRO-3's: the unwrapped model's state_dict, each unit gathered in turn (every rank gets it; save it on rank 0).
    Loads into the plain model with ``load_state_dict``."""
    observers, self._observers = self._observers, []  # an inspection, not a training step's working set
    try:
        for unit in self.units:
            unit.unshard(INSPECTION)
        state = {k: v.detach().clone() for k, v in self.module.state_dict().items()}
        for unit in self.units:
            unit.reshard()
    finally:
        self._observers = observers
    return self._with_masters(state, self._master_values() if self.master else {})


def state_dict_refused(self, *args, **kwargs):
    """ZeRO-3's ``state_dict()``: refused.  Its parameters are placeholders between uses (each rank holds shards), so
    nn.Module's would return 0-element tensors that load into nothing -- silently.  FSDP2 returns DTensors there;
    minizero names the two calls that give what a user wants."""
    raise RuntimeError(f"rank {self.rank}: {self.name} holds each parameter as shards, so state_dict() would return "
                       f"0-element placeholders: call stage.full_state_dict() for the whole model (every rank gets "
                       f"it; FSDP2: get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))), or "
                       f"minizero.checkpoint.save(stage, path) for a sharded checkpoint that any stage resumes")


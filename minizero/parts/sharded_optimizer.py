"""ZeRO's optimizer: the user's, rebuilt over the pieces of the parameters this rank owns.

Each :class:`~minizero.parts.layout.FlatGroup` hands out one *piece* per parameter its shard overlaps (a 1-D view
into the owned shard).  :class:`ShardedOptimizer` builds the user's optimizer class, with the user's per-group
hyper-parameters, over those pieces, so any element-wise ``torch.optim`` optimizer works unchanged and skips a
parameter without a gradient exactly as on one device.  Its ``param_groups`` are the user's (over the whole
parameters), so a learning-rate scheduler works as usual: every change is carried over before each step.

Two ways to use it: alone, with torch's ``ZeroRedundancyOptimizer`` calling convention
(``ShardedOptimizer(model.parameters(), torch.optim.AdamW, comm=comm, lr=1e-3)`` after gradients were averaged:
:meth:`step` takes this rank's shard, steps it, all-gathers -- 3Psi per step, torch's bytes); or inside the ZeRO
stages, which reduce-scatter gradients straight into the pieces (2Psi) and call :meth:`step_owned`.  Consolidation
is :mod:`minizero.parts.optimizer_state`.
"""
from __future__ import annotations

import torch

from ..comm import Comm, Tag
from .kept_state import keep_state
from .layout import FlatGroup, build_groups
from .masters import MasterWeights
from .optimizer_state import full_state_dict
from .part import flat_range
from .rebuilt import follow, rebuild

#: Optimizers whose update is element-wise, so a 1-D piece is as good as the parameter.
ELEMENTWISE = (torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW, torch.optim.Adamax, torch.optim.Adagrad,
               torch.optim.RMSprop, torch.optim.NAdam, torch.optim.RAdam, torch.optim.ASGD, torch.optim.Rprop)


def check_shardable(optimizer_class: type, rank: int) -> None:
    if optimizer_class not in ELEMENTWISE:
        raise TypeError(
            f"rank {rank}: {optimizer_class.__name__} cannot run on flat shards. ZeRO hands the optimizer the "
            f"1-D piece of each parameter a rank owns, which is only the same update for element-wise optimizers; "
            f"one that needs each parameter's shape (Adafactor, Shampoo, Muon) or a closure (LBFGS) would "
            f"compute something else. Use one of: {', '.join(c.__name__ for c in ELEMENTWISE)}.")


class ShardedOptimizer(torch.optim.Optimizer):
    """``ShardedOptimizer(params, optimizer_class, comm=comm, **defaults)``: ``optimizer_class`` over this
    rank's shard of ``params`` (see the module's docstring).  ``groups``: the flat layout a ZeRO stage
    already built; without it the parameters are laid out here."""

    def __init__(self, params, optimizer_class: type, *, comm: Comm, groups: list[FlatGroup] | None = None,
                 master: MasterWeights | None = None, **defaults):
        super().__init__(params, defaults)
        check_shardable(optimizer_class, comm.rank)
        self.comm, self.optimizer_class, self.master = comm, optimizer_class, master
        self.groups = groups if groups is not None else build_groups(self.param_groups, comm.rank, comm.world_size)
        in_group = {id(p): i for i, g in enumerate(self.param_groups) for p in g["params"]}
        self.local = rebuild(optimizer_class, self.defaults, self.param_groups,
                             [[self.stepped(piece) for g in self.groups for piece in g.pieces
                               if in_group.get(id(piece.segment.param)) == i] for i in range(len(self.param_groups))])

    @classmethod
    def from_optimizer(cls, optimizer: torch.optim.Optimizer, groups: list[FlatGroup], comm: Comm,
                       master: MasterWeights | None = None):
        """The sharded twin of a user's optimizer, sharing its param_groups (so its scheduler drives both).
        With ``master`` (mixed precision) it steps the pieces' fp32 masters.  State the user's optimizer
        already holds (two steps taken, a checkpoint loaded) moves over, each piece its range of it
        (:mod:`minizero.parts.kept_state`)."""
        check_shardable(type(optimizer), comm.rank)
        sharded = cls([{**g} for g in optimizer.param_groups], type(optimizer), comm=comm, groups=groups,
                      master=master, **optimizer.defaults)
        sharded.param_groups = optimizer.param_groups
        pieces: dict[int, list] = {}
        for group in groups:
            for piece in group.pieces:
                pieces.setdefault(id(piece.segment.param), []).append(
                    (piece.start, piece.stop, sharded.stepped(piece)))
        keep_state(optimizer, sharded.local, lambda p: pieces.get(id(p), []))
        return sharded

    def stepped(self, piece) -> torch.nn.Parameter:
        """What the local optimizer steps for ``piece``: the piece, or under mixed precision its fp32 master."""
        return self.master.master_of(piece.param) if self.master else piece.param

    def step_owned(self) -> bool:
        """Step the pieces that have a gradient, with the user's current hyper-parameters; under mixed
        precision through the masters (False: an overflow somewhere, the step skipped on every rank)."""
        follow(self.local, self.param_groups)
        if self.master:
            return self.master.step(self.local.step)
        self.local.step()
        return True

    @torch.no_grad()
    def step(self, closure=None) -> None:
        """Alone (after gradients were averaged): take this rank's shard, step, all-gather."""
        if closure is not None:
            raise TypeError("ShardedOptimizer.step takes no closure: it steps each rank's shard once")
        for group in self.groups:
            averaged = group.shard_of(group.pack_grads()).clone()  # this rank's shard only: the rest is freed
            for piece in group.pieces:
                has = piece.segment.param.grad is not None
                piece.param.grad = averaged[piece.offset:piece.offset + piece.stop - piece.start] if has else None
        if self.step_owned():
            self.share(range(len(self.groups)))

    def share(self, indices, tag_of=lambda g: Tag(f"group {g} parameters after step")) -> None:
        """Everyone gets everyone's updated shard (parameters are views of ``group.data``)."""
        for g in indices:
            group = self.groups[g]
            self.comm.all_gather(group.data, group.shard.detach().clone(), tag=tag_of(g))

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.local.zero_grad(set_to_none=set_to_none)
        super().zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict:
        """This rank's pieces only: what a sharded checkpoint stores per rank."""
        return self.local.state_dict()

    def full_state_dict(self) -> dict:
        """The state_dict of a plain torch optimizer over the whole parameters; every rank gets it."""
        return full_state_dict(self.local, self.param_groups, self.groups, self.comm, self.stepped)

    def load_full_state_dict(self, saved: dict) -> None:
        """The reverse of :meth:`full_state_dict`: from a plain optimizer's state_dict over the whole
        parameters (any stage's, any world size's), keep each piece's range of each per-element state, and
        the user's hyper-parameters.  No communication: every rank reads what it owns."""
        follow(self, saved["param_groups"])
        index = {id(p): i for i, p in enumerate(p for group in self.param_groups for p in group["params"])}
        self.local.state.clear()
        for group in self.groups:
            for piece in group.pieces:
                entry = saved["state"].get(index[id(piece.segment.param)])
                if entry:
                    target = self.stepped(piece)
                    self.local.state[target] = flat_range(entry, piece.start, piece.stop, like=target)

"""The optimizer of a ZeRO stage: the user's, rebuilt over the pieces this rank owns.

Each :class:`~minizero.layout.FlatGroup` hands out one *piece* per parameter
it owns part of (a 1-D view into the owned shard).  The user's optimizer class
and per-group hyper-parameters are rebuilt over those pieces, one param group
per user param group, so any element-wise ``torch.optim`` optimizer works
unchanged -- and, piece by piece, it skips a parameter without a gradient
exactly as it would on one device.

Consolidation (:func:`full_state_dict`) is the reverse: every rank's pieces of
each state tensor are laid back into the flat layout, all-gathered, and cut
into per-parameter tensors -- the state_dict a plain optimizer over the
unwrapped model would have.
"""
from __future__ import annotations

import inspect
import math

import torch

from .comm import Tag
from .layout import FlatGroup

#: Optimizers whose update is element-wise, so a 1-D piece is as good as the parameter.
ELEMENTWISE = (torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW, torch.optim.Adamax, torch.optim.Adagrad,
               torch.optim.RMSprop, torch.optim.NAdam, torch.optim.RAdam, torch.optim.ASGD, torch.optim.Rprop)


def check_shardable(optimizer: torch.optim.Optimizer, rank: int) -> None:
    if type(optimizer) not in ELEMENTWISE:
        raise TypeError(
            f"rank {rank}: {type(optimizer).__name__} cannot run on flat shards. ZeRO hands the optimizer the "
            f"1-D part of each parameter a rank owns, which is only the same update for element-wise optimizers; "
            f"one that needs each parameter's shape (Adafactor, Shampoo, Muon) or a closure (LBFGS) would "
            f"compute something else. Use one of: {', '.join(c.__name__ for c in ELEMENTWISE)}.")


def _accepted_defaults(optimizer: torch.optim.Optimizer) -> dict:
    # Each group carries all its settings; the constructor gets only the defaults it accepts
    # (AdamW's defaults hold keys, like decoupled_weight_decay, that its __init__ does not take).
    accepted = inspect.signature(type(optimizer).__init__).parameters
    return {k: v for k, v in optimizer.defaults.items() if k in accepted}


def shard_optimizer(optimizer: torch.optim.Optimizer, groups: list[FlatGroup]) -> torch.optim.Optimizer:
    """The same optimizer class and hyper-parameters, over this rank's pieces: param group ``i`` holds
    the pieces of the user's group ``i`` (possibly none: a rank may own only padding)."""
    param_groups = [{**{k: v for k, v in group.items() if k != "params"},
                     "params": [piece.param for g in groups if g.group_index == index for piece in g.pieces]}
                    for index, group in enumerate(optimizer.param_groups)]
    return type(optimizer)(param_groups, **_accepted_defaults(optimizer))


def attach_gradients(groups: list[FlatGroup], grad_shards: list[torch.Tensor], has_grad: set[int]) -> None:
    """Point each piece's ``.grad`` at its slice of the averaged gradient shard -- or None where the
    parameter got no gradient anywhere, so the optimizer skips it as torch.optim does."""
    for group, shard in zip(groups, grad_shards):
        for piece in group.pieces:
            piece.param.grad = (shard[piece.offset:piece.offset + piece.stop - piece.start]
                                if id(piece.segment.param) in has_grad else None)


def state_layout(optimizer: torch.optim.Optimizer, group_index: int, dtype: torch.dtype) -> dict:
    """What state this optimizer keeps per parameter with group ``group_index``'s settings:
    ``{key: ("element", dtype) | ("scalar", dtype) | ("constant", value)}``, found by stepping
    a one-element probe -- every rank gets the same answer, whichever pieces it owns."""
    settings = {k: v for k, v in optimizer.param_groups[group_index].items() if k != "params"}
    probe = torch.nn.Parameter(torch.zeros(1, dtype=dtype))
    probe.grad = torch.ones(1, dtype=dtype)
    stepped = type(optimizer)([{"params": [probe], **settings}], **_accepted_defaults(optimizer))
    stepped.step()
    layout = {}
    for key, value in stepped.state.get(probe, {}).items():
        if torch.is_tensor(value):
            layout[key] = ("element" if value.dim() == 1 else "scalar", value.dtype)
        else:
            layout[key] = ("constant", value)
    return layout


def full_state_dict(sharded: torch.optim.Optimizer, user_param_groups: list[dict], groups: list[FlatGroup],
                    comm) -> dict:
    """The state_dict of a plain torch optimizer over the unwrapped model; every rank gets it."""
    order = [p for group in user_param_groups for p in group["params"]]
    index = {id(p): i for i, p in enumerate(order)}
    state: dict[int, dict] = {}
    for g, group in enumerate(groups):
        layout = state_layout(sharded, group.group_index, group.dtype)
        if not layout:  # plain SGD keeps no state at all
            continue
        scalars = [k for k, (kind, _) in layout.items() if kind == "scalar"]
        has_state, scalar_values = _gather_scalars(sharded, group, scalars, comm, Tag(f"group {g} optimizer scalars"))
        per_param = {key: group.unpack_full(_gather_element_state(sharded, group, key, dtype, comm,
                                                                  Tag(f"group {g} optimizer {key}")))
                     for key, (kind, dtype) in layout.items() if kind == "element"}
        for i, segment in enumerate(group.segments):
            if not has_state[i]:
                continue
            entry = {}
            for key, (kind, detail) in layout.items():
                entry[key] = (per_param[key][i] if kind == "element" else
                              torch.tensor(scalar_values[i][scalars.index(key)], dtype=detail) if kind == "scalar"
                              else detail)
            state[index[id(segment.param)]] = entry
    param_groups = [{**{k: v for k, v in group.items() if k != "params"},
                     "params": [index[id(p)] for p in group["params"]]} for group in user_param_groups]
    return {"state": state, "param_groups": param_groups}


def _gather_scalars(sharded, group: FlatGroup, scalars: list[str], comm, tag: Tag):
    """Per segment: does any rank hold state for it, and its scalar states (Adam's step) from that rank."""
    width = 1 + len(scalars)
    table = torch.full((len(group.segments), width), math.nan, dtype=torch.float64)
    position = {id(s): i for i, s in enumerate(group.segments)}
    for piece in group.pieces:
        piece_state = sharded.state.get(piece.param)
        if piece_state:
            row = position[id(piece.segment)]
            table[row, 0] = 1.0
            for j, key in enumerate(scalars):
                table[row, 1 + j] = float(piece_state[key])
    everyone = torch.empty(comm.world_size * table.numel(), dtype=torch.float64)
    comm.all_gather(everyone, table.reshape(-1), tag=tag)
    everyone = everyone.view(comm.world_size, len(group.segments), width)
    has_state, values = [], []
    for i in range(len(group.segments)):
        owners = [r for r in range(comm.world_size) if everyone[r, i, 0] == 1.0]
        has_state.append(bool(owners))
        values.append(everyone[owners[0], i, 1:].tolist() if owners else [])
    return has_state, values


def _gather_element_state(sharded, group: FlatGroup, key: str, dtype: torch.dtype, comm, tag: Tag) -> torch.Tensor:
    """One state tensor (Adam's exp_avg, say) of the whole group, flat: each rank's pieces in place."""
    mine = torch.zeros(group.shard_size, dtype=dtype, device=group.shard.device)
    for piece in group.pieces:
        piece_state = sharded.state.get(piece.param)
        if piece_state and key in piece_state:
            mine[piece.offset:piece.offset + piece.stop - piece.start] = piece_state[key]
    full = mine.new_empty(group.shard_size * group.world_size)
    comm.all_gather(full, mine, tag=tag)
    return full

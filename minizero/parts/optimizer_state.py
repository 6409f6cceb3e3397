"""The sharded optimizer's state, consolidated: what a plain torch optimizer over the whole model would hold.

Every rank holds its pieces' state (:class:`~minizero.parts.sharded_optimizer.ShardedOptimizer`).  To consolidate,
each per-element state tensor (Adam's ``exp_avg``, ``exp_avg_sq``) is laid back into the flat layout, all-gathered
and cut into per-parameter tensors; per-parameter scalars (Adam's ``step``) are gathered from whichever rank owns a
piece of the parameter.  What the optimizer keeps is found by stepping a one-element probe (:func:`state_layout`),
so every rank knows it, whichever pieces it owns -- also a rank that owns none.
"""
from __future__ import annotations

import math

import torch

from ..comm import Tag
from .layout import FlatGroup
from .rebuilt import rebuild


def state_layout(optimizer: torch.optim.Optimizer, group_index: int, dtype: torch.dtype) -> dict:
    """What state this optimizer keeps per parameter with group ``group_index``'s settings:
    ``{key: ("element", dtype) | ("scalar", dtype) | ("constant", value)}``, found by stepping
    a one-element probe -- every rank gets the same answer, whichever pieces it owns."""
    probe = torch.nn.Parameter(torch.zeros(1, dtype=dtype))
    probe.grad = torch.ones(1, dtype=dtype)
    stepped = rebuild(type(optimizer), optimizer.defaults, [optimizer.param_groups[group_index]], [[probe]])
    stepped.step()
    layout = {}
    for key, value in stepped.state.get(probe, {}).items():
        if torch.is_tensor(value):
            layout[key] = ("element" if value.dim() == 1 else "scalar", value.dtype)
        else:
            layout[key] = ("constant", value)
    return layout


def full_state_dict(sharded: torch.optim.Optimizer, user_param_groups: list[dict], groups: list[FlatGroup],
                    comm, stepped=lambda piece: piece.param) -> dict:
    """The state_dict of a plain torch optimizer over the unwrapped model; every rank gets it."""
    order = [p for group in user_param_groups for p in group["params"]]
    index = {id(p): i for i, p in enumerate(order)}
    state: dict[int, dict] = {}
    for g, group in enumerate(groups):
        layout = state_layout(sharded, group.group_index, group.optimizer_dtype)
        if not layout:  # plain SGD keeps no state at all
            continue
        scalars = [k for k, (kind, _) in layout.items() if kind == "scalar"]
        has_state, scalar_values = _gather_scalars(sharded, group, scalars, comm, Tag(f"group {g} optimizer scalars"),
                                                    stepped)
        per_param = {key: group.unpack_full(_gather_element_state(sharded, group, key, dtype, comm,
                                                                  Tag(f"group {g} optimizer {key}"), stepped))
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


def _gather_scalars(sharded, group: FlatGroup, scalars: list[str], comm, tag: Tag, stepped):
    """Per segment: does any rank hold state for it, and its scalar states (Adam's step) from that rank."""
    width = 1 + len(scalars)
    table = torch.full((len(group.segments), width), math.nan, dtype=torch.float64)
    position = {id(s): i for i, s in enumerate(group.segments)}
    for piece in group.pieces:
        piece_state = sharded.state.get(stepped(piece))
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


def _gather_element_state(sharded, group: FlatGroup, key: str, dtype: torch.dtype, comm, tag: Tag,
                          stepped) -> torch.Tensor:
    """One state tensor (Adam's exp_avg, say) of the whole group, flat: each rank's pieces in place."""
    mine = torch.zeros(group.shard_size, dtype=dtype, device=group.shard.device)
    for piece in group.pieces:
        piece_state = sharded.state.get(stepped(piece))
        if piece_state and key in piece_state:
            mine[piece.offset:piece.offset + piece.stop - piece.start] = piece_state[key]
    # Every rank sends a shard, even one that owns none (a parameter server's worker): its zeros land past
    # the group's end, in slots no segment reads.
    full = mine.new_empty(group.shard_size * comm.world_size)
    comm.all_gather(full, mine, tag=tag)
    return full[:group.shard_size * group.world_size]

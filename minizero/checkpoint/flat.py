"""A ZeRO checkpoint as DeepSpeed writes one -- each rank's flat shards -- and resharding it from N ranks to M.

minizero's own checkpoints store *parts*, ranges of the parameters, which any stage at any N reads (lesson 12).
DeepSpeed's ZeRO checkpoints store what each rank holds: its shard of each flat group (the parameters of one
param group end to end, padded with zeros to a multiple of N, rank r owning ``[r*S, (r+1)*S)``, ``S = ceil(numel
/ N)``) and the optimizer's state for exactly that shard.  Such a checkpoint fits only the N that wrote it; on
another M it must be converted first -- DeepSpeed's ``ds_to_universal``.  This module is that format
(:class:`FlatShard`, :func:`save_flat_shards`, :func:`load_flat_shards`); the conversion is
:class:`~minizero.checkpoint.reshard.Reshard`, a module of its own (lab reshard's answer, apart from the format a
learner reads).

Adam's state is per element (``exp_avg``, ``exp_avg_sq``: cut like the parameters) but for its ``step``, a count
-- the same for every element of a group whose parameters are all stepped every step: kept whole.  ZeRO-1 and
ZeRO-2 in fp32 (under mixed precision the shard to save would be the fp32 master's; this format leaves it out).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..comm import ReduceOp, Tag
from ..parts.optimizer_state import state_layout


@dataclass
class FlatShard:
    """What rank ``rank`` of ``world_size`` holds of one flat group of ``numel`` elements: ``values``, its shard of
    the padded flat parameters (``ceil(numel / world_size)`` elements, zeros past ``numel``), and ``state``, the
    optimizer's state for it -- per-element tensors the shard's size, and 0-dim ones (Adam's ``step``) whole."""

    rank: int
    world_size: int
    numel: int
    values: torch.Tensor
    state: dict


def _saveable(stage) -> None:
    if getattr(stage, "groups", None) is None or stage.shards.parameters or stage.precision.mixed:
        raise ValueError(f"rank {stage.rank}: flat shards are ZeRO-1's and ZeRO-2's in fp32; this stage is "
                         f"{stage.name} in {stage.precision.name} (save it with minizero.checkpoint.save)")
    if stage.optimizer is None:
        raise ValueError(f"rank {stage.rank}: a flat shard holds the optimizer's state; this stage has no optimizer")


def save_flat_shards(stage) -> list[FlatShard]:
    """This rank's shard of each flat group of a ZeRO-1/2 ``stage``, with its optimizer state (every rank calls
    it: ranks agree on Adam's ``step`` -- a rank whose shard is all padding has no state to read it from)."""
    _saveable(stage)
    optimizer = stage.optimizer
    shards = []
    for g, group in enumerate(stage.groups):
        layout = state_layout(optimizer.local, group.group_index, group.optimizer_dtype)
        state, counts = {}, []
        for key, (kind, dtype) in layout.items():
            if kind == "element":
                state[key] = torch.zeros(group.shard_size, dtype=dtype)
        for piece in group.pieces:
            held = optimizer.local.state.get(optimizer.stepped(piece), {})
            for key, value in held.items():
                if key in state:
                    state[key][piece.offset:piece.offset + piece.stop - piece.start] = value.detach()
                elif torch.is_tensor(value):
                    counts.append(float(value))
        for key, (kind, dtype) in layout.items():
            if kind == "scalar":
                count = torch.tensor([max(counts, default=0.0)], dtype=torch.float64)
                stage.comm.all_reduce(count, ReduceOp.MAX, tag=Tag(f"group {g} optimizer {key}"))
                state[key] = count[0].to(dtype)
        shards.append(FlatShard(stage.rank, stage.world_size, group.numel, group.shard.detach().clone(), state))
    return shards


def load_flat_shards(stage, shards: list[FlatShard]) -> None:
    """Make ``shards`` -- one per flat group, this rank's of this stage's world size -- what ``stage`` holds: the
    owned shard of the parameters, every rank's all-gathered into the full buffers, and the optimizer's state
    for each piece of the shard.  A shard of another size than this rank owns is refused, naming it."""
    _saveable(stage)
    if len(shards) != len(stage.groups):
        raise ValueError(f"rank {stage.rank}: {len(shards)} flat shard(s) for {len(stage.groups)} flat group(s)")
    optimizer = stage.optimizer
    for g, (group, shard) in enumerate(zip(stage.groups, shards, strict=True)):
        where = f"rank {stage.rank} of {stage.world_size}, flat group {g} ({group.numel} elements)"
        for name, tensor in [("values", shard.values)] + [(k, v) for k, v in shard.state.items() if v.dim()]:
            if tuple(tensor.shape) != (group.shard_size,):
                raise ValueError(f"{where}: the shard's {name} has shape {tuple(tensor.shape)}; this rank owns "
                                 f"{group.shard_size} elements (ceil({group.numel} / {stage.world_size}), padding "
                                 f"included)")
        with torch.no_grad():
            group.shard.copy_(shard.values)
            stage.comm.all_gather(group.data, group.shard.detach().clone(), tag=Tag(f"group {g} loaded shards"))
        for piece in group.pieces:
            target = optimizer.stepped(piece)
            a, b = piece.offset, piece.offset + piece.stop - piece.start
            optimizer.local.state[target] = {
                key: (value[a:b].to(target.dtype, copy=True) if value.dim() else value.detach().clone())
                for key, value in shard.state.items()}
    stage.remember_shared()  # loading is not a step: the full parameters are current

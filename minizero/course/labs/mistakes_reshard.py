"""Known mistakes of the reshard lab: resharders with one classic slip each, and what the learner did.

Resharding is arithmetic on tensors, so a failure is named here without any rank: each mistake reshards the very
shards the learner's did, in the checker's own process, and the one that gives exactly the learner's tensors is
named (:func:`named`).
"""
from __future__ import annotations

import torch

from ...checkpoint.flat import FlatShard
from ...checkpoint.reshard import Reshard


class OldShardSize(Reshard):
    """Cuts the new ranges with the shard size the N ranks had: right only when N = M."""

    mistake = ("you cut the new shards with the old shard size, ceil(numel / N) of the ranks that saved, instead of "
               "ceil(numel / M) of the ranks that load")
    name = "reshard-old-shard-size"

    def reshard(self, saved, world_size, rank):
        numel = saved[0].numel
        size = -(-numel // world_size)
        start = rank * -(-numel // saved[0].world_size)  # the old size: the slip

        def cut(parts):
            mine = torch.cat(parts)[:numel][start:start + size]
            return torch.cat([mine, mine.new_zeros(size - mine.numel())])

        state = {k: cut([s.state[k] for s in saved]) if v.dim() else v.clone() for k, v in saved[0].state.items()}
        return FlatShard(rank, world_size, numel, cut([s.values for s in saved]), state)


class StepRestarted(Reshard):
    """Reshards the tensors and starts Adam's step count again."""

    mistake = ("you started Adam's step count again from 0: the moments came over, but the bias correction "
               "1 - beta^step restarted, so the next steps are far too large")
    name = "reshard-step-restarted"

    def reshard(self, saved, world_size, rank):
        shard = super().reshard(saved, world_size, rank)
        shard.state = {k: torch.zeros_like(v) if not v.dim() else v for k, v in shard.state.items()}
        return shard


RESHARD_MISTAKES = (OldShardSize, StepRestarted)


def _same(a: FlatShard, b: FlatShard) -> bool:
    tensors = [(a.values, b.values)] + [(a.state.get(k), v) for k, v in b.state.items()]
    return set(a.state) == set(b.state) and all(
        torch.is_tensor(x) and x.shape == y.shape and torch.equal(x.to(y.dtype), y) for x, y in tensors)


def named(saved: list[list[FlatShard]], world_size: int, shards: list[list]) -> str | None:
    """The known mistake that builds exactly ``shards`` (``shards[r]``: rank r's, one per flat group) from
    ``saved``, if one does."""
    for mistake in RESHARD_MISTAKES:
        try:
            theirs = [mistake().reshard_all(saved, world_size, r) for r in range(world_size)]
        except Exception:  # noqa: BLE001 -- a mistake that cannot run on this case is not this one
            continue
        if len(shards) == len(theirs) and all(
                len(mine) == len(its) and all(isinstance(m, FlatShard) and _same(m, t) for m, t in zip(mine, its, strict=True))
                for mine, its in zip(shards, theirs, strict=True)):
            return mistake.mistake
    return None

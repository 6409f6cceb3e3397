"""Resharding a DeepSpeed-style ZeRO checkpoint (:mod:`.flat`) from the N ranks that wrote it to M: DeepSpeed's
``ds_to_universal``, done in memory -- each flat group's N shards laid end to end, the old padding dropped, cut again
into M ranges and padded with zeros.  Adam's per-element state is cut like the parameters; its ``step``, a count the
same for every element, is kept whole.
"""
from __future__ import annotations

import torch

from ..parts.layout import padded_size
from .flat import FlatShard


class Reshard:
    """Rank ``rank`` of M's flat shards from the shards N ranks saved: DeepSpeed's conversion, group by group."""

    def owned_range(self, numel: int, world_size: int, rank: int) -> tuple[int, int]:
        """``[start, stop)`` of the padded flat buffer that rank ``rank`` of ``world_size`` owns."""
        size = padded_size(numel, world_size) // world_size
        return rank * size, (rank + 1) * size

    def reshard(self, saved: list[FlatShard], world_size: int, rank: int) -> FlatShard:
        """Rank ``rank`` of ``world_size``'s shard of one flat group, from ``saved`` (rank k's shard at ``saved[k]``):
        every per-element tensor laid end to end over the N shards, the old padding dropped, cut to the new
        range and padded with zeros; a 0-dim state (Adam's ``step``) kept whole."""
        numel = saved[0].numel
        start, stop = self.owned_range(numel, world_size, rank)

        def cut(shards: list[torch.Tensor]) -> torch.Tensor:
            whole = torch.cat(shards)[:numel]
            out = whole.new_zeros(stop - start)
            mine = whole[start:stop]
            out[:mine.numel()] = mine
            return out

        state = {key: cut([s.state[key] for s in saved]) if value.dim() else value.clone()
                 for key, value in saved[0].state.items()}
        return FlatShard(rank, world_size, numel, cut([s.values for s in saved]), state)

    def reshard_all(self, saved: list[list[FlatShard]], world_size: int, rank: int) -> list[FlatShard]:
        """Every flat group's shard for rank ``rank`` of ``world_size``; ``saved[k]``: rank k's shards, one per
        group, as :func:`save_flat_shards` returned them."""
        groups = list(zip(*saved, strict=True))
        return [self.reshard(list(shards), world_size, rank) for shards in groups]

"""Clamps the shard's start into the group ("keep the index in range"): the same for every rank whose range begins
inside the group, but a rank whose range begins past its end -- all padding -- gets the group's last element."""
from __future__ import annotations

import torch

from minizero.checkpoint.flat import FlatShard
from minizero.course.labs import given


class Reshard(given.Reshard):
    def owned_range(self, numel, world_size, rank):
        size = -(-numel // world_size)
        return rank * size, (rank + 1) * size

    def reshard(self, saved, world_size, rank):
        numel = saved[0].numel
        start, stop = self.owned_range(numel, world_size, rank)

        def cut(tensors):
            group = torch.cat(tensors)[:numel]
            mine = group[min(start, numel - 1):stop]
            return torch.cat([mine, mine.new_zeros(stop - start - mine.numel())])

        state = {}
        for key, value in saved[0].state.items():
            state[key] = cut([s.state[key] for s in saved]) if value.dim() else value.clone()
        return FlatShard(rank, world_size, numel, cut([s.values for s in saved]), state)

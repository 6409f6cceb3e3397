"""Lab ``reshard`` in another style: the saved shards concatenated into the whole flat group, then this rank's range
sliced out (and padded) -- more memory than range by range, the same values."""
from __future__ import annotations

import torch

from minizero.checkpoint.flat import FlatShard
from minizero.course.labs.skeletons.contract.reshard import Reshard as Skeleton


class Reshard(Skeleton):
    def owned_range(self, numel, world_size, rank):
        size = -(-numel // world_size)
        return size * rank, size * (rank + 1)

    def reshard(self, saved, world_size, rank):
        numel = saved[0].numel
        start, stop = self.owned_range(numel, world_size, rank)

        def mine(parts):
            whole = torch.cat(parts)[:numel]  # the saved shards' padding dropped
            padded = torch.cat([whole, whole.new_zeros(max(0, stop - numel))])
            return padded[start:stop].clone()

        state = {}
        for key, value in saved[0].state.items():
            state[key] = mine([s.state[key] for s in saved]) if value.dim() else value.clone()
        return FlatShard(rank, world_size, numel, mine([s.values for s in saved]), state)

"""Pools of ranks kept alive across many runs: how the property suite and the labs' checker run hundreds of examples
without paying a process spawn (1-3 s) per example."""
from __future__ import annotations

from typing import Any, Callable

from .launch import RankPool


class RankPools:
    """One live :class:`RankPool` per world size, replaced when a failure broke it: how the property
    suite and the labs' checker run hundreds of examples without a process spawn per example."""

    def __init__(self, timeout_s: float = 300.0):
        self.timeout_s = timeout_s
        self._pools: dict[int, RankPool] = {}

    def run(self, world_size: int, fn: Callable[..., Any], *args, **kwargs) -> list[Any]:
        return self.pool(world_size).run(fn, *args, **kwargs)

    def run_within(self, idle_s: float, world_size: int, fn: Callable[..., Any], *args, **kwargs) -> list[Any]:
        """:meth:`RankPool.run_within` on the live pool of ``world_size`` ranks."""
        return self.pool(world_size).run_within(idle_s, fn, *args, **kwargs)

    def pool(self, world_size: int) -> RankPool:
        """The live pool of ``world_size`` ranks, started now if there is none."""
        pool = self._pools.get(world_size)
        if pool is None or pool.broken:
            pool = self._pools[world_size] = RankPool(world_size, timeout_s=self.timeout_s)
        return pool

    def live(self) -> dict[int, RankPool]:
        return {n: pool for n, pool in self._pools.items() if not pool.broken}

    def close(self) -> None:
        for pool in self._pools.values():
            pool.close()

    def __enter__(self) -> "RankPools":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

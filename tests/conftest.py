"""Shared test machinery.

* Hypothesis runs derandomized (a fixed seed, no deadline) so a red CI run
  replays exactly; ``MINIZERO_DEEP=1`` (``make test-deep``) draws many more,
  fresh examples for hunting.
* Examples run on a persistent pool of ranks per world size: spawning a
  world costs seconds, running one example on a live pool a few ms.
"""
from __future__ import annotations

import os

import pytest
from hypothesis import HealthCheck, settings

from minizero.launch import RankPool

settings.register_profile("ci", derandomize=True, deadline=None, max_examples=30, print_blob=True,
                          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
settings.register_profile("deep", derandomize=False, deadline=None, max_examples=600, print_blob=True,
                          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
settings.load_profile("deep" if os.environ.get("MINIZERO_DEEP") else "ci")


class Pools:
    """One live RankPool per world size; a pool broken by a failure is replaced."""

    def __init__(self):
        self._pools: dict[int, RankPool] = {}

    def run(self, world_size: int, fn, *args, **kwargs):
        pool = self._pools.get(world_size)
        if pool is None or pool.broken:
            pool = self._pools[world_size] = RankPool(world_size, timeout_s=120)
        return pool.run(fn, *args, **kwargs)

    def close(self):
        for pool in self._pools.values():
            pool.close()


@pytest.fixture(scope="session")
def pools():
    p = Pools()
    yield p
    p.close()

"""Shared test machinery.

* Hypothesis runs derandomized (a fixed seed, no deadline) so a red CI run
  replays exactly; ``MINIZERO_DEEP=1`` (``make test-deep``) draws many more,
  fresh examples for hunting.
* Examples run on a persistent pool of ranks per world size: spawning a
  world costs seconds, running one example on a live pool a few ms.
* Pools use a short stall timeout (``TIMEOUT_S``): an example that hangs fails
  in seconds, naming the rank that stopped, instead of after minutes.
"""
from __future__ import annotations

import os
from contextlib import contextmanager

import pytest
from hypothesis import HealthCheck, settings

from minizero.launch import RankPools

settings.register_profile("ci", derandomize=True, deadline=None, max_examples=30, print_blob=True,
                          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
settings.register_profile("deep", derandomize=False, deadline=None, max_examples=600, print_blob=True,
                          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
settings.load_profile("deep" if os.environ.get("MINIZERO_DEEP") else "ci")


TIMEOUT_S = 8.0  # seconds a collective may go without progress in the suite


def _on_rank(me, action, name):
    from tests import patch_mutants
    getattr(patch_mutants, action)(name)


class Pools(RankPools):
    """The suite's pools, with mutants that can be put in place in every rank."""

    def __init__(self):
        super().__init__(timeout_s=TIMEOUT_S)

    @contextmanager
    def patched(self, name: str):
        """Mutant ``name`` in place here and in every rank -- live pools now, and pools forked while it
        is in place (they inherit it) -- then taken out everywhere."""
        from tests import patch_mutants
        patch_mutants.apply(name)
        try:
            for pool in self.live().values():
                pool.run(_on_rank, "apply", name)
            yield
        finally:
            patch_mutants.undo(name)
            for pool in self.live().values():
                pool.run(_on_rank, "undo", name)


@pytest.fixture(scope="session")
def pools():
    p = Pools()
    yield p
    p.close()

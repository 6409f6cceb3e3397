"""Stage ``ps-async``: the parameter server with stale pulls -- and the answer it no longer equals.

In an asynchronous parameter server (Dean et al.'s Downpour SGD, NeurIPS 2012;
Ho et al.'s Stale Synchronous Parallel, NeurIPS 2013) no worker waits for the
others: each pulls whatever parameters the servers hold when its request
arrives, and its gradient reaches the servers after they have already applied
others'.  So a gradient is computed on parameters ``tau`` updates old.  With
a staleness bound ``s`` (SSP), ``0 <= tau <= s``.

This stage models the staleness, not the asynchrony: every step is still
synchronous -- every rank pushes, the servers average all N gradients and
apply one update -- and only the parameters a rank pulls are old.  It has no
straggler tolerance and no per-worker updates (Downpour's, Hogwild!'s); lesson
11 says so.

A real cluster draws ``tau`` from its timing, so no two runs agree and no test
could replay one.  Here the **schedule** draws it -- seeded, per step and rank
(:func:`delay`) -- and the servers keep their last ``s`` versions to answer a
pull with the one ``tau`` steps old.  Everything else is ``ps``: the same
push, the same servers' step, the same bytes (every rank still pulls every
step; it just receives an older version).  So:

* ``staleness=0`` *is* ``ps``, bit for bit (tested);
* for ``s > 0`` the run departs from single-device training, by an amount
  that grows with ``s`` -- measured by ``compare`` and plotted in lesson 13
  against ``s``.

Memory: a server keeps its current shard apart from the copy its own worker
computes with, and ``s`` old versions: ``(s + 1) Psi / S`` more than ``ps``.
Checkpoints are refused: the workers hold models of different ages, which no
single-device state describes.
"""
from __future__ import annotations

import random
from collections import deque

import torch
from torch import nn

from ..comm import Comm
from ..parts.layout import FlatGroup, build_groups
from ..parts.precision import Precision
from .options import WIRE_AND_USE, Option, natural_int
from .ps import SERVERS, ParameterServer


def delay(seed: int, step: int, rank: int, staleness: int) -> int:
    """How many updates old the parameters are that ``rank`` computes step ``step + 1`` on: uniform in
    ``0..staleness``, the same on every rank (each server reads it for every destination)."""
    return random.Random(f"{seed}:{step}:{rank}").randint(0, staleness) if staleness else 0


class ServedGroup(FlatGroup):
    """A flat group whose owned shard -- the server's parameters, what the optimizer steps -- lives apart
    from the full buffer, which is the rank's *worker* copy: the two may differ in age."""

    def _keep(self, owned: torch.Tensor) -> torch.Tensor:
        return owned.clone()

    @torch.no_grad()
    def load_full(self, full: torch.Tensor) -> None:
        super().load_full(full)
        self.shard.copy_(self.shard_of(self.data))


class AsyncParameterServer(ParameterServer):
    name = "ps-async"
    equivalent = False  # stale gradients: by design not single-device training (tested to differ)
    why_not_checkpointable = "its workers hold parameters of different ages"
    options = (SERVERS, Option("staleness", 2, "pulls at most this many updates old (0: ps)", natural_int),
               Option("schedule_seed", 0, "the seed of the staleness schedule", natural_int), *WIRE_AND_USE)

    def __init__(self, module: nn.Module, optimizer: torch.optim.Optimizer | None = None, comm: Comm | None = None,
                 servers: int = 1, staleness: int = 2, schedule_seed: int = 0, **common):
        if isinstance(staleness, bool) or not isinstance(staleness, int) or staleness < 0:
            raise ValueError(f"rank {comm.rank if comm is not None else 0}: stage {self.name!r} takes staleness as "
                             f"a whole number of steps >= 0 (0 is the synchronous ps), got {staleness!r}")
        self.staleness, self.schedule_seed = staleness, schedule_seed
        self.version = 0  # updates the servers have applied
        self._history: deque = deque(maxlen=staleness)  # the servers' previous versions, newest last
        super().__init__(module, optimizer, comm, servers, **common)  # wire, find_unused_parameters, precision

    def layout(self) -> list:
        return build_groups(self.param_groups(), self.rank, self.servers, self.names(), group_class=ServedGroup)

    def step(self) -> None:
        with self.stepping():
            before = [group.shard.detach().clone() for group in self.groups] if self.staleness else None
            if self.optimizer.step_owned():  # (a step skipped for fp16 overflow makes no new version)
                if before is not None:
                    self._history.append(before)
                self.version += 1
                self.all_gather_parameters()

    def all_gather_parameters(self) -> None:
        """Pull, each rank receiving the version the schedule says: ``delay`` updates old (or the oldest
        kept, in the first steps)."""
        ages = [min(delay(self.schedule_seed, self.version, r, self.staleness), len(self._history))
                for r in range(self.world_size)]
        for g, group in self.stepped_groups():
            versions = [group.shard.detach()] + [old[g] for old in reversed(self._history)]
            self.comm.pull(group.data, group.shard.detach().clone(), self.servers,
                           stale=[versions[age] for age in ages], tag=self.tag(f"group {g} parameters after step"))
        self.remember_shared()

    @staticmethod
    def _version_of(group) -> int:
        """The server's shard lives apart from the worker copy: a step bumps the shard's version."""
        return group.shard._version

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """The servers' parameters -- the model an asynchronous run has trained -- not this worker's
        possibly stale copy, which is put back after."""
        worker_copies = [group.data.clone() for group in self.groups]
        try:
            for g, group in enumerate(self.groups):
                self.gather(group.data, group.shard.detach().clone(), tag=self.tag(f"group {g} servers' parameters"))
            return super().full_state_dict()
        finally:
            with torch.no_grad():
                for group, copy in zip(self.groups, worker_copies, strict=True):
                    group.data.copy_(copy)

    def held_tensors(self) -> dict[str, list[torch.Tensor]]:
        held = super().held_tensors()
        held["server_versions"] = [group.shard for group in self.groups] + [t for old in self._history for t in old]
        return held

    # ------------------------------------------------------------------ facts
    @classmethod
    def state_bytes(cls, psi, world_size, element_size, state_tensors, precision=None, servers: int = 1,
                    staleness: int = 2, **options) -> float:
        """``ps``'s, plus a server's own shard apart from its worker's copy and ``s`` old versions of it."""
        working = Precision.of(precision).working_bytes(element_size)
        return (super().state_bytes(psi, world_size, element_size, state_tensors, precision, servers)
                + psi * (staleness + 1) * working / servers)

    @classmethod
    def state_formula(cls, element_size, state_tensors, precision=None, **options) -> str:
        working = Precision.of(precision).working_bytes(element_size)
        return f"{super().state_formula(element_size, state_tensors, precision)} + {working}(s+1)Ψ/S"

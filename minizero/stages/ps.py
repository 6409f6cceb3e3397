"""Stage ``ps``: the synchronous parameter server -- the design the ring all-reduce replaced.

``S`` server ranks hold the authoritative parameters and the optimizer, each
for its ``1/S`` slice; every rank is also a worker (servers co-located with
workers, as MXNet's KVStore allows; BytePS puts them on CPU machines), so
the global batch is every other stage's.  One step:

1. backward, exactly as in ZeRO-1: gradients accumulate in one flat buffer
   per group, padded to a multiple of ``S``;
2. **push**: every rank sends slice ``j`` of its gradients to server ``j``,
   which averages the ``N`` contributions (:mod:`minizero.comm.star`);
3. server ``j`` steps its slice with the user's optimizer -- states exist
   for that slice alone;
4. **pull**: every rank receives every server's updated slice.

It is the *same update* as DDP and single-device training (the property
suite proves it).  What differs is the traffic's shape.  Summed over ranks it
moves ``2(N-1) Psi`` elements per step, exactly a ring all-reduce; but with
``S = 1`` the server sends ``(N-1) Psi`` of them, a load that grows with ``N``
while every other rank's stays flat -- the bottleneck (Li et al., "Scaling
Distributed Machine Learning with the Parameter Server", OSDI 2014, shard
the server for this reason).  With ``S = N`` every rank sends
``2(N-1)/N Psi``: a reduce-scatter and an all-gather done with direct
messages, which is ZeRO-1 (section 5.1 of the ZeRO paper) on a star instead
of a ring.

Memory: each rank keeps the full parameters and gradients, as DDP does; a
server adds the optimizer states of its slice, ``K Psi / S``.
"""
from __future__ import annotations

import torch
from torch import nn

from ..comm import Comm
from ..compress import reduce_scatter_mean
from ..cost_model import pull_s, push_s
from ..formulas import all_gather_bytes, reduce_scatter_bytes
from ..layout import build_groups
from ..precision import Precision
from .facts import Reduction, Shards
from .options import WIRE_AND_USE, Option, positive_int
from .zero1 import ZeRO1

SERVERS = Option("servers", 1, "ranks 0..S-1 serve a slice each (1: one server)", positive_int,
                 draw=lambda d: range(1, d.world_size + 1))


class ParameterServer(ZeRO1):
    name = "ps"
    shards = Shards()  # divides nothing among the N data-parallel ranks: the S servers hold the optimizer
    contrast = True  # the design the ring all-reduce replaced
    options = (SERVERS, *WIRE_AND_USE)

    def __init__(self, module: nn.Module, optimizer: torch.optim.Optimizer | None = None, comm: Comm | None = None,
                 servers: int = 1, compress: str | None = None, error_feedback: bool = False,
                 find_unused_parameters: bool = False, precision: str | Precision = "fp32"):
        world_size = comm.world_size if comm is not None else 1
        if isinstance(servers, bool) or not isinstance(servers, int) or not 1 <= servers <= world_size:
            raise ValueError(f"rank {comm.rank if comm is not None else 0}: stage {self.name!r} takes servers "
                             f"from 1 to the world size {world_size} (ranks 0..S-1 serve, every rank works), "
                             f"got {servers!r}")
        if optimizer is None:  # a worker owns no slice: an optimizer built over stage.parameters() would be empty
            raise ValueError(f"rank {comm.rank if comm is not None else 0}: stage {self.name!r} keeps the optimizer "
                             f"on its servers, so it must be given at wrap time: pass yours to make_stage(name, "
                             f"model, optimizer, comm) instead of building one over stage.parameters() afterwards")
        self.servers = servers  # before ZeRO-1 lays the groups out: over the servers, not the N ranks
        super().__init__(module, optimizer, comm, compress, error_feedback, find_unused_parameters, precision)

    def layout(self) -> list:
        """The flat groups, sharded over the S servers: a rank from S on owns no slice (a pure worker)."""
        return build_groups(self.param_groups(), self.rank, self.servers, self.names())

    def reduce(self, buffer: torch.Tensor, owned: torch.Tensor, index: int, names: list[str], tag) -> None:
        """Push: server j gets the mean of slice j (over the wire's dtype, if compressed)."""
        reduce_scatter_mean(self.comm, self.wire, buffer, owned, index, names, tag=tag, servers=self.servers)

    def gather(self, full: torch.Tensor, shard: torch.Tensor, tag) -> None:
        """Pull: every rank's full buffer from the servers' slices."""
        self.comm.pull(full, shard, self.servers, tag=tag)

    # ------------------------------------------------------------------ facts
    @classmethod
    def sent_bytes_per_step(cls, psi, world_size, grad_bytes, param_bytes, servers: int = 1, **options) -> float:
        """The mean over ranks (what ``compare`` reports for every stage): ``(N-1)/N Psi`` each way, ZeRO-1's."""
        return reduce_scatter_bytes(psi * grad_bytes, world_size) + all_gather_bytes(psi * param_bytes, world_size)

    @classmethod
    def busiest_sent_bytes_per_step(cls, psi, world_size, grad_bytes, param_bytes, servers: int = 1,
                                    **options) -> float:
        """What the busiest rank sends: a server pushes ``(S-1)/S Psi`` and pulls out ``(N-1)/S Psi``; a
        worker (there is one when ``S < N``) pushes ``Psi``."""
        if world_size == 1:
            return 0.0
        server = psi * ((servers - 1) * grad_bytes + (world_size - 1) * param_bytes) / servers
        return max(server, psi * grad_bytes if servers < world_size else 0.0)

    @classmethod
    def state_bytes(cls, psi, world_size, element_size, state_tensors, precision=None, servers: int = 1,
                    **options) -> float:
        """A server's model states: ZeRO-1's terms with ``S`` servers in place of ``N`` ranks."""
        whole, divided = ZeRO1.state_terms(element_size, state_tensors, precision)
        return psi * (whole + divided / servers)

    @classmethod
    def state_formula(cls, element_size, state_tensors, precision=None, **options) -> str:
        whole, divided = ZeRO1.state_terms(element_size, state_tensors, precision)
        return " + ".join([f"{whole}Ψ"] * bool(whole) + [f"{divided}Ψ/S"] * bool(divided)) or "0"

    @classmethod
    def schedule(cls, s, servers: int = 1, **options) -> None:
        """Push after backward, pull after the servers' step: neither hides, and both wait on a server."""
        plan, net = s.plan, s.plan.network
        s.forward()
        s.backward()
        s.blocking_s(push_s(plan.psi * plan.grad_bytes, plan.world_size, servers, net), net.alpha)
        s.optimizer_step()
        s.blocking_s(pull_s(plan.psi * plan.param_bytes, plan.world_size, servers, net),
                     (plan.world_size - 1) * net.alpha)

    @classmethod
    def reduction(cls, model, optimizer, world_size, servers: int = 1, **options) -> Reduction:
        """ZeRO-1's buffers, padded to a multiple of S and cut into S slices (summed in the ring's order)."""
        return Reduction(ZeRO1.reduction(model, optimizer, world_size).buffers, padded=True, slices=servers)

"""Stage ``ps``: the synchronous parameter server -- the design the ring all-reduce replaced.

``S`` server ranks hold the authoritative parameters and the optimizer, each
for its shard, ``1/S`` of every flat group; every rank is also a worker (servers co-located with
workers, as MXNet's KVStore allows; BytePS puts them on CPU machines), so
the global batch is every other stage's.  One step:

1. backward, exactly as in ZeRO-1: gradients accumulate in one flat buffer
   per group, padded to a multiple of ``S``;
2. **push**: every rank sends shard ``j`` of its gradients to server ``j``,
   which averages the ``N`` contributions (:mod:`minizero.comm.star`);
3. server ``j`` steps its shard with the user's optimizer -- states exist
   for that shard alone;
4. **pull**: every rank receives every server's updated shard.

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
server adds the optimizer states of its shard, ``K Psi / S``.
"""
from __future__ import annotations

import torch
from torch import nn

from ..comm import Comm, ReduceOp
from ..compress import WirePolicy
from ..costs.cost_model import pull_s, push_s
from ..costs.formulas import all_gather_bytes, reduce_scatter_bytes
from ..parts.grad_buffers import FullGradients
from ..parts.layout import build_groups
from ..parts.precision import Precision
from .facts import GradientMemory, Reduction, Shards
from .options import WIRE_AND_USE, Option, positive_int
from .zero import ZeRO
from .zero1 import ZeRO1

SERVERS = Option("servers", 1, "ranks 0..S-1 serve a shard each (1: one server)", positive_int,
                 draw=lambda d: range(1, d.world_size + 1))


class ParameterServer(ZeRO):
    name = "ps"
    gradient_memory = GradientMemory(kept=True)  # FullGradients, as ZeRO-1
    shards = Shards()  # divides nothing among the N data-parallel ranks: the S servers hold the optimizer
    contrast = True  # the design the ring all-reduce replaced
    averages_with = "push"  # a star, summed at the servers: the 16-bit wire fits it, a codec's messages do not
    options = (SERVERS, *WIRE_AND_USE)

    def __init__(self, module: nn.Module, optimizer: torch.optim.Optimizer | None = None, comm: Comm | None = None,
                 servers: int = 1, *, wire: WirePolicy | str = WirePolicy(), find_unused_parameters: bool = False,
                 precision: Precision | str = "fp32"):
        world_size = comm.world_size if comm is not None else 1
        if isinstance(servers, bool) or not isinstance(servers, int) or not 1 <= servers <= world_size:
            raise ValueError(f"rank {comm.rank if comm is not None else 0}: stage {self.name!r} takes servers "
                             f"from 1 to the world size {world_size} (ranks 0..S-1 serve, every rank works), "
                             f"got {servers!r}")
        if optimizer is None:  # a worker owns no shard: an optimizer built over stage.parameters() would be empty
            raise ValueError(f"rank {comm.rank if comm is not None else 0}: stage {self.name!r} keeps the optimizer "
                             f"on its servers, so it must be given at wrap time: pass yours to make_stage(name, "
                             f"model, optimizer, comm) instead of building one over stage.parameters() afterwards")
        self.servers = servers
        super().__init__(module, optimizer, comm, wire=wire, find_unused_parameters=find_unused_parameters,
                         precision=precision)  # no offload: the optimizer lives on the servers
        self.shard(self.layout())
        self.full_grads = FullGradients(self.groups)  # ZeRO-1's: full gradients, each .grad a view
        self.zero_grad()
        self.hook_grouped_parameters()

    def layout(self) -> list:
        """The flat groups, sharded over the S servers: a rank from S on owns no shard (a pure worker)."""
        return build_groups(self.param_groups(), self.rank, self.servers, self.names())

    # ------------------------------------------------------------ backward: ZeRO-1's, with a push
    def pre_backward(self) -> None:
        self.full_grads.open_if_closed()

    def post_accumulate_grad(self, param: nn.Parameter) -> None:
        self._used.add(id(param))
        self.full_grads.keep(param)

    def pre_forward(self) -> None:
        if torch.is_grad_enabled():  # (workers never step outside: no share)
            self.full_grads.open_if_closed()

    def post_backward(self) -> None:
        """Push: server j gets the mean of shard j of every rank's gradients (over the wire, if compressed)."""
        used = self.used_after_backward()
        for index, (group, buffer) in enumerate(zip(self.groups, self.full_grads.buffers, strict=True)):
            self.comm.push(group.shard_of(buffer), buffer, self.servers, ReduceOp.AVG,
                           tag=self.tag(f"group {index} gradients"), wire=self.wire, key=index)
            self.full_grads.take_averaged(index, used)
        self.full_grads.window_open = False

    # ------------------------------------------------------------ the servers' step, and a pull
    def step(self) -> None:
        with self.stepping():
            if self.optimizer.step_owned():  # a worker owns no piece: its step changes nothing
                self.all_gather_parameters()

    def all_gather_parameters(self) -> None:
        """Pull: every rank's full parameters from the servers' shards."""
        for g, group in self.stepped_groups():
            self.gather(group.data, group.shard.detach().clone(), tag=self.tag(f"group {g} parameters after step"))
        self.remember_shared()

    def gather(self, full: torch.Tensor, shard: torch.Tensor, tag) -> None:
        """Pull: every rank's ``full`` from the servers' shards."""
        self.comm.pull(full, shard, self.servers, tag=tag)

    # ------------------------------------------------------------------ facts
    @classmethod
    def check_command_line(cls, world_size: int, steps: int, given: dict) -> None:
        servers = given.get("servers")
        if servers is not None and servers > world_size:
            raise ValueError(f"--servers {servers} on {world_size} rank(s): ranks 0..S-1 serve a shard each, so there "
                             f"can be at most {world_size}; use --servers {world_size} or fewer (or more ranks)")

    @classmethod
    def sent_bytes_by_link(cls, *args, **options) -> None:
        """A star, not a ring: which link a push or pull crosses depends on where the servers sit (not stated)."""
        return None

    @classmethod
    def after_backward_elements(cls, psi, world_size, servers: int = 1, **options) -> float:
        """A server's push (:meth:`~minizero.comm.star.StarExchanges.push`): its own contribution copied aside and one
        receive buffer, its shard's size each (under NCCL one per sender: N - 1 of them)."""
        return 2 * psi / servers

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
        plan, net = s.plan, s.plan.slowest  # a star, on a cluster at the slow wire's pace
        s.forward()
        s.backward()
        s.blocking_s(push_s(plan.psi * plan.grad_bytes, plan.world_size, servers, net), net.alpha)
        s.optimizer_step()
        s.blocking_s(pull_s(plan.psi * plan.param_bytes, plan.world_size, servers, net),
                     (plan.world_size - 1) * net.alpha)

    @classmethod
    def reduction(cls, model, optimizer, world_size, servers: int = 1, **options) -> Reduction:
        """ZeRO-1's buffers, padded to a multiple of S and cut into S shards (summed in the ring's order)."""
        return Reduction(ZeRO1.reduction(model, optimizer, world_size).buffers, padded=True, shards=servers)

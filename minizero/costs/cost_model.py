"""The scaling model: one step's time from the α–β network, the ring's formulas and each stage's overlap.

A ring collective over ``N`` ranks is ``N-1`` steps (an all-reduce ``2(N-1)``),
each one message of ``1/N`` of the tensor per rank, so on a network of latency
``alpha`` and bandwidth ``beta`` (:class:`~minizero.comm.network.Network`)::

    all_reduce(S)      = 2(N-1) * (alpha + S / (N beta))
    reduce_scatter(S)  =  (N-1) * (alpha + S / (N beta))     (all_gather the same)

The bandwidth term tends to ``2S/beta`` however many ranks there are -- why
rings scale -- while the latency term ``2(N-1) alpha`` grows with ``N``: at
thousands of ranks small collectives are all latency, which is why NCCL
switches to trees (``2 log2(N) alpha``) there.

*What hides behind what* is each stage's own fact: its
:meth:`~minizero.stages.base.Stage.schedule` replays one step as a program
on two resources, the main thread (compute) and the communication thread
(one collective at a time, in issue order -- exactly :mod:`minizero.comm.thread`).
A collective launched during backward runs while backward computes; a wait
blocks the main thread until it ends.  Backward produces gradients at a
uniform rate per parameter, last registered first (compute proportional to
parameters: the 6 Psi FLOPs per token rule), so a bucket is ready when
backward has reached its last parameter.  The optimizer step is a given
compute time (``StepPlan.step_s``); host overheads are not modelled.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from ..comm.network import Network, TwoLevel
from ..comm.nodes import Nodes
from .cluster_cost import RING_STEPS, collective_s, nodes_for

MAX_COLLECTIVES = 100_000  # buckets or units one step may replay: beyond, the model would take minutes


def ring_s(kind: str, nbytes: float, world_size: int, network: Network) -> float:
    """Seconds of a ring ``kind`` on a full tensor of ``nbytes`` over ``world_size`` ranks."""
    steps = RING_STEPS[kind] * (world_size - 1)
    return steps * (network.alpha + nbytes / world_size / network.bandwidth)


def ring_latency_s(kind: str, world_size: int, network: Network) -> float:
    """The latency part of :func:`ring_s`: ``RING_STEPS * (N-1) * alpha``."""
    return RING_STEPS[kind] * (world_size - 1) * network.alpha


def root_all_reduce_s(nbytes: float, world_size: int, network: Network) -> float:
    """The parameter server's all-reduce at its root: N-1 tensors stream in through one port (their
    latencies overlap), then N-1 go out one after another -- ``alpha + (N-1)S/beta + (N-1)(alpha + S/beta)``."""
    n = world_size - 1
    return network.alpha + n * nbytes / network.bandwidth + n * network.message_s(nbytes) if n else 0.0


def push_s(nbytes: float, world_size: int, servers: int, network: Network) -> float:
    """The parameter server's push (:mod:`minizero.comm.star`): each server takes ``N-1`` shards of
    ``nbytes/servers`` in through one port (their latencies overlap), while a worker sends one shard to
    each server in turn; the step waits for the slower."""
    n, shard = world_size - 1, nbytes / servers
    if not n:
        return 0.0
    sends = servers if servers < world_size else n  # a pure worker's messages, or a server's (its own stays)
    return max(network.alpha + n * shard / network.bandwidth, sends * network.message_s(shard))


def pull_s(nbytes: float, world_size: int, servers: int, network: Network) -> float:
    """The pull: each server sends its shard to the ``N-1`` other ranks, one message after another."""
    return (world_size - 1) * network.message_s(nbytes / servers)


def tree_latency_s(kind: str, world_size: int, network: Network) -> float:
    """A binary tree's latency for the same collective, for contrast: up and down, ``log2 N`` hops each."""
    return RING_STEPS[kind] * (world_size - 1).bit_length() * network.alpha


@dataclass(frozen=True)
class StepPlan:
    """What the model knows of one step: the model's shape, compute times, element sizes, the network.

    ``blocks``: parameters per unit in forward order, ``blocks[0]`` the root's (embeddings and head;
    0 if all parameters are in the blocks) -- ZeRO-3's units.  ``buckets``: parameters per bucket in
    reduction order (last registered first), or None to cut ``bucket_mb`` buckets from the sum."""

    world_size: int
    network: Network
    forward_s: float
    backward_s: float
    blocks: tuple[float, ...]
    grad_bytes: int = 4
    param_bytes: int = 4
    buckets: tuple[float, ...] | None = None
    options: dict = field(default_factory=dict)
    step_s: float = 0.0  # the optimizer step's compute (measured; 0 when not given)
    hierarchical: bool = False  # the world's collectives in two levels (the hierarchical backend)

    @property
    def psi(self) -> float:
        return float(sum(self.blocks))

    @property
    def nodes(self) -> Nodes:
        """Where the ranks sit: nodes of the cluster's ``G`` (one node on a flat network)."""
        return nodes_for(self.world_size, self.network)

    @property
    def slowest(self) -> Network:
        """One flat network standing for the cluster, for exchanges modelled only as stars (the parameter
        server): its slowest wire (the inter-node one, where there are several nodes)."""
        net = self.network
        if not isinstance(net, TwoLevel):
            return net
        wire = net.inter if self.nodes.count > 1 else net.intra
        return wire if wire is not None else Network(0.0, 1e30, "free")

    def collective_s(self, kind: str, nbytes: float, span: str = "world") -> tuple[float, float]:
        """Seconds of ring ``kind`` on ``nbytes`` among the ``span`` ranks, and their alpha part
        (:mod:`minizero.costs.cluster_cost`)."""
        return collective_s(kind, nbytes, self.network, self.nodes, span, self.hierarchical)

    def bucket_sizes(self, bucket_mb: float = 25.0) -> list[float]:
        if self.buckets is not None:
            return list(self.buckets)
        cap = max(1.0, float(int(bucket_mb * (1 << 20) / self.param_bytes)))  # whole parameters, at least one
        full, rest = divmod(self.psi, cap)
        if full > MAX_COLLECTIVES:
            raise ValueError(f"bucket_mb={bucket_mb:g} cuts {self.psi:.3g} parameters into {int(full):,} buckets, more "
                             f"than the model replays ({MAX_COLLECTIVES:,}); give a larger bucket size")
        return [cap] * int(full) + ([rest] if rest else [])


@dataclass
class Prediction:
    step_s: float
    compute_s: float
    comm_s: float  # the collectives' total time, hidden or not
    latency_s: float  # the alpha part of comm_s
    tree_latency_s: float  # what the same collectives' latency would be as trees

    @property
    def exposed_s(self) -> float:
        return self.step_s - self.compute_s

    @property
    def efficiency(self) -> float:
        """Compute over step time: 1 when all communication hides (weak scaling, batch per rank fixed)."""
        return self.compute_s / self.step_s if self.step_s > 0 else 1.0


class Schedule:
    """One rank's step as a program: :meth:`compute` on the main thread, :meth:`launch` on the
    communication thread (in order, one at a time), :meth:`wait` for a launched collective."""

    def __init__(self, plan: StepPlan):
        self.plan = plan
        self.t = 0.0  # the main thread's clock
        self._free = 0.0  # when the communication thread is next free
        self._ends: dict = {}
        self.compute_s = self.comm_s = self.latency_s = self.tree_latency_s = 0.0

    # ---------------------------------------------------------------- primitives
    def compute(self, seconds: float) -> None:
        self.t += seconds
        self.compute_s += seconds

    def launch(self, key, kind: str, numel: float, element_bytes: int, span: str = "world") -> None:
        """Queue a collective among the ``span`` ranks -- all of them, or on a cluster a node's or the ranks
        across nodes (HSDP's mesh) -- (a no-op for nothing, or for one rank: nothing to exchange)."""
        cost, alpha = self.plan.collective_s(kind, numel * element_bytes, span) if numel > 0 else (0.0, 0.0)
        start = max(self.t, self._free)
        self._free = self._ends[key] = start + cost
        self.comm_s += cost
        if numel > 0:
            n = {"world": self.plan.world_size, "node": self.plan.nodes.per_node, "across": self.plan.nodes.count}[span]
            self.latency_s += alpha
            self.tree_latency_s += tree_latency_s(kind, n, self.plan.slowest) if span != "node" else alpha

    def launched(self, key) -> bool:
        return key in self._ends

    def wait(self, key) -> None:
        self.t = max(self.t, self._ends[key])

    def blocking(self, kind: str, numel: float, element_bytes: int) -> None:
        key = ("blocking", len(self._ends))
        self.launch(key, kind, numel, element_bytes)
        self.wait(key)

    def blocking_s(self, seconds: float, latency_s: float) -> None:
        """A blocking exchange whose time the stage models itself (the parameter server's push and pull)."""
        self.wait_all()
        self.t = self._free = self.t + seconds
        self.comm_s += seconds
        self.latency_s += latency_s
        self.tree_latency_s += latency_s

    def wait_all(self) -> None:
        self.t = max(self.t, self._free)

    # ---------------------------------------------------------------- the shapes stages share
    def forward(self) -> None:
        self.compute(self.plan.forward_s)

    def backward(self) -> None:
        self.compute(self.plan.backward_s)

    def optimizer_step(self) -> None:
        self.compute(self.plan.step_s)

    def backward_in_buckets(self, kind: str, bucket_mb: float = 25.0) -> None:
        """Backward, launching ``kind`` of each bucket as its last gradient is ready (then wait for all)."""
        sizes = self.plan.bucket_sizes(bucket_mb)
        per_param = self.plan.backward_s / max(sum(sizes), 1.0)
        for i, numel in enumerate(sizes):
            self.compute(numel * per_param)
            self.launch(("bucket", i), kind, numel, self.plan.grad_bytes)
        self.wait_all()

    def result(self) -> Prediction:
        return Prediction(self.t, self.compute_s, self.comm_s, self.latency_s, self.tree_latency_s)


def predict(stage_class, plan: StepPlan) -> Prediction:
    """Replay ``stage_class``'s schedule for one step on ``plan``."""
    schedule = Schedule(plan)
    stage_class.schedule(schedule, **plan.options)
    return schedule.result()

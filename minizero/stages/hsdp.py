"""Stage ``hsdp``: ZeRO-3 inside each node, DDP across nodes -- FSDP2's hybrid sharding (HSDP), DeepSpeed's MiCS.

ZeRO-3 over all ``N = M x G`` ranks of ``M`` nodes puts every all-gather and reduce-scatter on a ring that
crosses the slow inter-node link, three times a step.  HSDP draws a 2-D mesh over the cluster -- FSDP2's
``init_device_mesh("cuda", (M, G))``, the replicate dimension first -- and

* **shards within a node**: parameters, gradients and optimizer states cut into ``G`` shards, one per rank
  of the node; a unit's all-gather before forward and backward, and the gradients' reduce-scatter, stay on
  the fast intra-node link;
* **replicates across nodes**: the ``M`` ranks at one place on every node hold the same shard; after the
  reduce-scatter each all-reduces its averaged shard with its replicas -- the only traffic between nodes,
  ``2(M-1)/M`` of ``Psi/G`` per rank, against ZeRO-3's ``3(N-1)/N`` of ``Psi`` on a ring through the slow link.

The price is memory: model states divided by ``G``, not ``N`` (``16 Psi / G`` for fp32 Adam).  The mean is
the same: the reduce-scatter averages the node's ``G`` gradients, the all-reduce the ``M`` nodes' means --
the mean of all ``N`` (exactly, for any split of N <= 4 into nodes: one of the two divisions is by 1 or 2).

Everything else is ZeRO-3's (:mod:`.zero3`): units, prefetch, resharding after forward, replicated modules,
checkpoints -- with its collectives on the node's ranks (:meth:`ZeRO.mesh`).  Checks that
every rank must agree on (the model at wrap time, which parameters have a gradient anywhere, the loss) stay
on all N ranks.  A checkpoint is written by the first replica of each shard and reads into any stage at
any N and node shape.
"""
from __future__ import annotations

import torch

from ..comm import Comm, Nodes, ReduceOp
from ..comm.nodes import assumed_nodes
from ..compress import PowerSGD, Wire, WirePolicy, overflow
from ..compress import parse as parse_compress
from ..costs.formulas import all_reduce_bytes
from ..parts.precision import REDUCE_DTYPES
from .facts import Reduction
from .zero3 import ZeRO3


class HSDP(ZeRO3):
    name = "hsdp"
    needs_nodes = True  # its mesh is where the ranks sit (network="nodes=MxG,..."; else assumed_nodes)
    averages_with = "all_reduce"  # a compressed wire rides the all-reduce across nodes: the slow hop only

    def __init__(self, module, optimizer=None, comm: Comm | None = None, units=None, reshard_after_forward: bool = True,
                 prefetch: int = 1, replicate=None, **common):
        self.check_combination(wire=common.get("wire"), precision=common.get("precision"))
        super().__init__(module, optimizer, comm, units=units, reshard_after_forward=reshard_after_forward,
                         prefetch=prefetch, replicate=replicate, **common)
        # Inside the node the gradients travel exact -- or, under a precision policy's wider reduce_dtype, summed in
        # it as every stage sums them: that is the summation's dtype, not compression.
        reduce_dtype = self.precision.reduce_dtype
        self.node_wire = Wire(self.shard_comm, REDUCE_DTYPES[reduce_dtype], overflow_raises=not self.precision.scaled) \
            if reduce_dtype is not None else None
        self.deferring += overflow.defer([self.node_wire])

    @classmethod
    def check_combination(cls, wire=None, precision=None, **others) -> None:
        compress = WirePolicy.of(wire).compress
        if isinstance(parse_compress(compress), PowerSGD):
            raise ValueError(f"compress={compress!r} on hsdp is not built: its compressed all-reduce is of gradient "
                             f"shards, and a shard of a matrix has no low-rank factors of its own; use a codec "
                             f"(int8, int4, topk, sign) or compress='fp16' or 'bf16'")
        super().check_combination(wire=wire, precision=precision, **others)

    def mesh(self, comm: Comm) -> tuple[Comm, Comm]:
        """Shard over this rank's node, replicate over the ranks at its place on every node.  A Comm that does
        not know where its ranks sit gets :func:`~minizero.comm.nodes.assumed_nodes` (two nodes when N is even,
        one rank per node when odd), stated as :attr:`nodes`."""
        self.nodes = comm.nodes_or_assumed("hsdp")
        node, across = self.nodes.node_ranks(comm.rank), self.nodes.across_ranks(comm.rank)
        return comm.over(node), comm.over(across)

    def average_shard(self, averaged: torch.Tensor, full: torch.Tensor, tag, key) -> None:
        """The node's mean of my shard (fast link), then the mean of the nodes' means (slow link: the only hop a
        ``compress=`` wire compresses)."""
        self.shard_comm.reduce_scatter(averaged, full, ReduceOp.AVG, tag=tag, wire=self.node_wire, key=key)
        self.replica_comm.all_reduce(averaged, ReduceOp.AVG, tag=tag, wire=self.wire, key=key)

    def average_whole(self, full: torch.Tensor, tag, key) -> None:
        """A replicated module's buffer: averaged in the node, then across nodes (a hierarchical all-reduce)."""
        self.shard_comm.all_reduce(full, ReduceOp.AVG, tag=tag, wire=self.node_wire, key=key)
        self.replica_comm.all_reduce(full, ReduceOp.AVG, tag=tag, wire=self.wire, key=key)

    # ------------------------------------------------------------------ facts
    @classmethod
    def sent_bytes_by_link(cls, psi, world_size, grad_bytes, param_bytes, nodes: Nodes | None = None,
                           hierarchical: bool = False, **options) -> dict[str, float]:
        """Per rank and step: ZeRO-3's bytes among the node's ``G`` ranks; the shard's all-reduce among ``M`` (its
        mesh's own collectives, whatever the backend does with the world's)."""
        nodes = _nodes(nodes, world_size)
        # ``grad_bytes`` are the wire's; a compressed wire rides the slow hop only, and inside the node the
        # gradients travel as they are: in the working dtype, the parameters' bytes
        inside = param_bytes if options.get("compress") not in (None, "none") else grad_bytes
        return {"intra": ZeRO3.sent_bytes_per_step(psi, nodes.per_node, inside, param_bytes, **options),
                "inter": all_reduce_bytes(psi * grad_bytes / nodes.per_node, nodes.count)}

    @classmethod
    def sent_bytes_per_step(cls, psi, world_size, grad_bytes, param_bytes, nodes: Nodes | None = None,
                            **options) -> float:
        return sum(cls.sent_bytes_by_link(psi, world_size, grad_bytes, param_bytes, nodes, **options).values())

    shard_symbol = "G"  # ZeRO-3's model states, divided by the node's G ranks instead of all N

    @classmethod
    def shard_count(cls, world_size, nodes: Nodes | None = None, **options) -> int:
        return _nodes(nodes, world_size).per_node

    shard_span = "node"  # the scaling model gathers and reduce-scatters inside the node...

    @classmethod
    def schedule_reduction(cls, s, key, numel: float) -> None:
        """... and all-reduces each shard across the nodes, after its reduce-scatter, on the same thread."""
        s.launch(key, "reduce_scatter", numel, s.plan.grad_bytes, span="node")
        s.launch((key, "across"), "all_reduce", numel / s.plan.nodes.per_node, s.plan.grad_bytes, span="across")

    @classmethod
    def reduction(cls, model, optimizer, world_size, nodes: Nodes | None = None, **options) -> Reduction:
        plain, nodes = ZeRO3.reduction(model, optimizer, world_size, **options), _nodes(nodes, world_size)
        return Reduction(plain.buffers, padded=True, shards=nodes.per_node, whole=plain.whole, replicas=nodes.count)


def _nodes(nodes: Nodes | None, world_size: int) -> Nodes:
    """The nodes a fact is stated for: those given, or those a Comm without nodes is assumed to have."""
    return nodes if nodes is not None else assumed_nodes(world_size)

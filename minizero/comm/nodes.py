"""Where the ranks sit: nodes of ``G`` ranks each, a fast link inside a node and a slow one between nodes.

Every cluster has two networks.  Inside a node the GPUs talk over NVLink (hundreds of GB/s); between nodes
each node has one or a few NICs (InfiniBand or Ethernet, tens of GB/s) that **all of its ranks share**.
torchrun places ranks node by node -- ``RANK = node * G + LOCAL_RANK`` -- so rank ``r`` sits on node
``r // G``, and minizero's ring, which sends from ``r`` to ``r + 1``, crosses between nodes only at a node's
last rank: one slow hop per node per ring step, as NCCL's rings are laid out.

:class:`Nodes` is that placement, nothing more: which link a message from ``a`` to ``b`` takes, and the two
groups a rank belongs to -- its node's ranks (where HSDP shards, where a hierarchical collective's first
and last phases run) and the ranks at its place on every node (FSDP2's *replicate* dimension of a 2-D
``DeviceMesh``, where the slow phase runs).  The link's speed is :mod:`.network`'s business.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

INTRA, INTER = "intra", "inter"  # the two link classes the ledger counts bytes under
LINKS = (INTRA, INTER)


@dataclass(frozen=True)
class Nodes:
    """``count`` nodes of ``per_node`` ranks; rank ``r`` on node ``r // per_node`` (torchrun's order)."""

    count: int
    per_node: int

    def __post_init__(self):
        for what, value in (("node count", self.count), ("ranks per node", self.per_node)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"nodes: the {what} must be a whole number >= 1, got {value!r}")

    @property
    def world_size(self) -> int:
        return self.count * self.per_node

    def node_of(self, rank: int) -> int:
        return rank // self.per_node

    def link(self, a: int, b: int) -> str:
        """The link a message from rank ``a`` to rank ``b`` crosses."""
        return INTRA if self.node_of(a) == self.node_of(b) else INTER

    def node_ranks(self, rank: int) -> list[int]:
        """The ranks of ``rank``'s node, in order: the group HSDP shards over (FSDP2's shard dimension)."""
        first = self.node_of(rank) * self.per_node
        return list(range(first, first + self.per_node))

    def across_ranks(self, rank: int) -> list[int]:
        """The ranks at ``rank``'s place on every node, node by node: the replicas of one shard (FSDP2's
        replicate dimension); the group the inter-node phase of a hierarchical collective runs in."""
        local = rank % self.per_node
        return [node * self.per_node + local for node in range(self.count)]

    def groups(self) -> list[list[int]]:
        """Every node group, then every across group: the order every rank creates them in (torch's
        ``new_group`` is collective: all ranks must call it for every group, in the same order)."""
        return ([list(range(k * self.per_node, (k + 1) * self.per_node)) for k in range(self.count)]
                + [self.across_ranks(j) for j in range(self.per_node)])

    def describe(self) -> str:
        return f"{self.count} node{'s' if self.count != 1 else ''} x {self.per_node} rank{'s' if self.per_node != 1 else ''}"

    def check(self, world_size: int, rank: int) -> None:
        if self.world_size != world_size:
            raise ValueError(f"rank {rank}: nodes={self.count}x{self.per_node} places {self.world_size} ranks, but this "
                             f"run has {world_size}; give nodes=MxG with M*G = {world_size} (e.g. nodes=1x{world_size})")


def assumed_nodes(world_size: int) -> Nodes:
    """Where a stage whose mesh is the nodes (HSDP) puts ``world_size`` ranks whose Comm was given none: two
    nodes when N is even, one rank per node when it is odd -- so it shards *and* replicates wherever it can,
    and every caller that runs each stage runs it.  Give the network's nodes to choose."""
    count = 2 if world_size % 2 == 0 else world_size
    return Nodes(count, world_size // count)


def parse_nodes(text: "str | Nodes") -> Nodes:
    """``"2x4"``: 2 nodes of 4 ranks each (``M x G``, as a cluster is usually described)."""
    if isinstance(text, Nodes):
        return text
    match = re.fullmatch(r"\s*(\d+)\s*[xX*]\s*(\d+)\s*", text)
    if not match:
        raise ValueError(f"nodes {text!r}: give NODESxRANKS_PER_NODE, e.g. 2x4 (2 nodes of 4 ranks)")
    return Nodes(int(match.group(1)), int(match.group(2)))

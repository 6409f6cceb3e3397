"""Communication: collectives from send/recv (``ring``) or torch's (``native``)."""
import torch.distributed as dist

from .base import Comm
from .collective import ReduceOp, chunk_bounds
from .fingerprint import KINDS, CollectiveMismatch, OutOfStep, Tag
from .hierarchical import HierarchicalComm
from .ledger import Ledger
from .native import NativeComm, ring_bytes_sent, ring_messages
from .network import PRESETS, Network, TwoLevel, parse_network
from .nodes import INTER, INTRA, LINKS, Nodes, parse_nodes
from .port import Port
from .ring import RingComm
from .thread import AllOf, Work

BACKENDS = {"ring": RingComm, "native": NativeComm, "hierarchical": HierarchicalComm}


def make_comm(backend: str = "ring", group: dist.ProcessGroup | None = None, check: bool = False,
              network: "str | Network | None" = None) -> Comm:
    """The communication layer for this rank; ``backend`` is ``ring``, ``native`` or ``hierarchical`` (the ring's
    all-reduce, reduce-scatter and all-gather in two levels, on a network with nodes: :mod:`.hierarchical`).

    ``check=True`` fingerprints every collective, so ranks that disagree on what
    comes next stop with an error naming both calls (see :mod:`.fingerprint`).
    ``network`` dials the network: every message waits ``alpha + bytes/bandwidth``
    (``"alpha=2ms,bandwidth=50MB/s"`` or a preset, see :mod:`.network`); ``"nodes=2x4,intra=nvlink,inter=..."``
    places the ranks on nodes, each link class on its own wire, and the ledger counts bytes per link class."""
    try:
        cls = BACKENDS[backend]
    except KeyError:
        raise ValueError(f"unknown comm backend {backend!r}; choose one of {sorted(BACKENDS)}") from None
    return cls(group, check, parse_network(network))


__all__ = ["AllOf", "BACKENDS", "INTER", "INTRA", "KINDS", "LINKS", "PRESETS", "CollectiveMismatch", "Comm", "OutOfStep",
           "HierarchicalComm", "Ledger", "Network", "Nodes", "Port", "Tag", "NativeComm", "ReduceOp", "RingComm", "TwoLevel",
           "Work", "chunk_bounds", "make_comm", "parse_network", "parse_nodes", "ring_bytes_sent", "ring_messages"]

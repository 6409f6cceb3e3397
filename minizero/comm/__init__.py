"""Communication: collectives from send/recv (``ring``) or torch's (``native``)."""
import torch.distributed as dist

from .base import Comm, ReduceOp, chunk_bounds
from .fingerprint import KINDS, CollectiveMismatch, Tag
from .ledger import Ledger
from .native import NativeComm, ring_bytes_sent, ring_messages
from .network import PRESETS, Network, Port, parse_network
from .ring import RingComm
from .thread import Work

BACKENDS = {"ring": RingComm, "native": NativeComm}


def make_comm(backend: str = "ring", group: dist.ProcessGroup | None = None, check: bool = False,
              network: "str | Network | None" = None) -> Comm:
    """The communication layer for this rank; ``backend`` is ``ring`` or ``native``.

    ``check=True`` fingerprints every collective, so ranks that disagree on what
    comes next stop with an error naming both calls (see :mod:`.fingerprint`).
    ``network`` dials the network: every message waits ``alpha + bytes/bandwidth``
    (``"alpha=2ms,bandwidth=50MB/s"`` or a preset, see :mod:`.network`)."""
    try:
        cls = BACKENDS[backend]
    except KeyError:
        raise ValueError(f"unknown comm backend {backend!r}; choose one of {sorted(BACKENDS)}") from None
    return cls(group, check, parse_network(network))


__all__ = ["BACKENDS", "KINDS", "PRESETS", "CollectiveMismatch", "Comm", "Ledger", "Network", "Port", "Tag", "NativeComm",
           "ReduceOp", "RingComm", "Work", "chunk_bounds", "make_comm", "parse_network", "ring_bytes_sent", "ring_messages"]

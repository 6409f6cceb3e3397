"""Communication: collectives from send/recv (``ring``) or torch's (``native``)."""
import torch.distributed as dist

from .base import KINDS, Comm, ReduceOp, Work, chunk_bounds
from .ledger import Ledger
from .native import NativeComm, ring_bytes_sent
from .ring import RingComm

BACKENDS = {"ring": RingComm, "native": NativeComm}


def make_comm(backend: str = "ring", group: dist.ProcessGroup | None = None) -> Comm:
    """The communication layer for this rank; ``backend`` is ``ring`` or ``native``."""
    try:
        cls = BACKENDS[backend]
    except KeyError:
        raise ValueError(f"unknown comm backend {backend!r}; choose one of {sorted(BACKENDS)}") from None
    return cls(group)


__all__ = ["BACKENDS", "KINDS", "Comm", "Ledger", "NativeComm", "ReduceOp", "RingComm", "Work",
           "chunk_bounds", "make_comm", "ring_bytes_sent"]

"""Averaging over a codec's messages: every rank sends its message whole, every rank adds all of them up.

For one buffer (named ``key``) on rank r, one step:

1. ``carried = x_r + e_r`` -- the gradient plus, with error feedback, what this rank's codec failed to send
   last time (``e_r``, kept per buffer);
2. ``m_r = encode(carried)``, and with error feedback ``e_r <- carried - decode(m_r)``: what is not sent now is
   sent later, so over any number of steps ``sum(decoded) + e_r = sum(x_r)`` -- nothing is lost, only late;
3. **all-gather** the messages (``(N-1)·|m|`` bytes per rank on the ring), then on every rank
   ``mean = (decode(m_0) + ... + decode(m_{N-1})) / N`` in rank order -- the same order everywhere, so every
   rank gets the same bits, and the reference can reproduce them.

Only an all-reduce fits: a reduce-scatter (ZeRO) would want each rank's message cut per shard and sent
through an all-to-all (ZeRO++'s qgZ) -- not built here, so those stages refuse these codecs by name.
"""
from __future__ import annotations

import zlib

import torch

from ..comm import Comm
from .codec import Codec
from .kept import KeepsResiduals


def stream(rank: int, carried: torch.Tensor) -> torch.Generator:
    """The random numbers a stochastic codec rounds ``carried`` with on rank ``rank``: seeded by the values
    themselves (a checksum of their bytes) and the rank -- so the reference draws the same ones without
    knowing the stage's buffer names or order, and a resumed run the same ones without a saved counter."""
    checksum = zlib.crc32(carried.detach().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    return torch.Generator().manual_seed(checksum ^ (rank * 0x9E3779B1 & 0xFFFFFFFF))


def mean_in_rank_order(decoded: list[torch.Tensor]) -> torch.Tensor:
    """The decoded messages' mean, added in rank order: what every rank (and the reference) computes."""
    total = torch.zeros_like(decoded[0])
    for x in decoded:
        total += x
    return total / len(decoded)


class GatheredWire(KeepsResiduals):
    """A codec's wire, with optional error feedback; a stage passes it as ``wire=`` to its all-reduce."""
    runs_own_collectives = True

    def __init__(self, comm: Comm, codec: Codec, error_feedback: bool = False):
        self.comm, self.codec, self.error_feedback = comm, codec, error_feedback
        self.residuals: dict = {}  # key -> what this rank has not yet sent of that buffer
        self.formula_bytes = 0  # what the ledger should count: each message to N-1 ranks

    @property
    def wire_dtype(self) -> str:
        """What travels, as a checkpoint records it (a resumed run must use the same codec)."""
        return self.codec.spec()

    def reduce(self, kind: str, arguments: dict, key, tag, layout=None) -> None:
        if kind != "all_reduce":
            raise ValueError(f"rank {self.comm.rank}: compress={self.codec.spec()!r} averages by all-gathering whole "
                             f"messages, which fits an all-reduce only; this {kind} would need an all-to-all")
        tensor = arguments["tensor"]
        flat = tensor.reshape(-1)
        carried = flat.clone()
        residual = self.residuals.get(key)
        if self.error_feedback and residual is not None:
            if residual.shape != carried.shape:
                raise ValueError(f"rank {self.comm.rank}: the error-feedback residual of bucket {key!r} has "
                                 f"{residual.numel()} elements and the bucket {carried.numel()}: the checkpoint was "
                                 f"saved with another bucket size; resume with the --bucket-mb it was saved with")
            carried += residual
        on_host = carried.cpu()
        message = self.codec.encode(on_host, stream(self.comm.rank, on_host) if self.codec.stochastic else None)
        message = message.to(tensor.device)
        self.formula_bytes += (self.comm.world_size - 1) * self.codec.message_bytes(flat.numel(), flat.dtype)
        gathered = message.new_empty(self.comm.world_size * message.numel())
        self.comm.all_gather(gathered, message, tag=tag)
        decoded = [self.codec.decode(m.cpu(), flat.numel(), flat.dtype) for m in gathered.chunk(self.comm.world_size)]
        mean = mean_in_rank_order(decoded)
        if not bool(torch.isfinite(mean).all()):  # never written into the weights, the residual kept as it was
            raise FloatingPointError(f"rank {self.comm.rank}: inf/NaN in the {self.codec.name} wire's mean of "
                                     f"{(tag.describe() if tag else 'a gradient buffer')}; the weights were not touched")
        if self.error_feedback:
            self.residuals[key] = carried - decoded[self.comm.rank].to(carried.device)  # what was sent, decoded
        flat.copy_(mean.to(tensor.device))

"""Averaging over a codec's messages, which do not add up on the way: each rank's messages are delivered whole.

For one buffer (named ``key``) on rank r, one step:

1. ``carried = x_r + e_r`` -- the gradient plus, with error feedback, what this rank's codec failed to send
   last time (``e_r``, kept per buffer);
2. ``m_r = encode(carried)``, and with error feedback ``e_r <- carried - decode(m_r)``: what is not sent now is
   sent later, so over any number of steps ``sum(decoded) + e_r = sum(x_r)`` -- nothing is lost, only late;
3. an **all-reduce** (``ddp``): **all-gather** the messages (``(N-1)·|m|`` bytes per rank), then on every rank
   ``mean = (decode(m_0) + ... + decode(m_{N-1})) / N`` in rank order -- the same order everywhere, so every
   rank gets the same bits, and the reference can reproduce them.  A **reduce-scatter** (ZeRO): the buffer is
   cut into its N shards first, each encoded on its own (``m_r = m_r,0 ... m_r,N-1``), and shard j's message
   goes to rank j only -- an **all-to-all**, ZeRO++'s qgZ -- which decodes its N messages and averages them in
   rank order: ``(N-1)·|m|/N`` bytes per rank, a reduce-scatter's share, where an all-gather's grows with N.
"""
from __future__ import annotations

import struct
import zlib

import torch

from ..comm import Comm
from .codec import Codec
from .kept import KeepsResiduals
from .overflow import RefusesNonFinite


def stream(rank: int, count: int, piece: int) -> torch.Generator:
    """The random numbers a stochastic codec rounds a buffer's ``piece`` with (a reduce-scatter's shard, or 0 for
    a whole buffer) on rank ``rank`` (of the collective's group), the ``count``-th time that buffer is averaged.

    Seeded by where it is, never by the values: the stage's backward and the reference's may sum a gradient in
    another order (a last-bit difference the tolerance allows), and a stream seeded by the values' bytes then
    drew other numbers altogether and moved a value by a code step (``make test-deep`` found it twice: float64,
    then float32).  The count is kept per buffer and saved in checkpoints beside the residuals, so a resumed run
    draws what the uninterrupted one would.  Buffers of one length averaged as often draw the same numbers on a
    rank: their rounding errors are alike position by position, each still unbiased; every rank's are its own,
    so the mean's error still shrinks as 1/N."""
    return torch.Generator().manual_seed(zlib.crc32(struct.pack("<3I", rank, count, piece)))


def stream_of_values(rank: int, values: torch.Tensor) -> torch.Generator:
    """The stream for ``values`` that must round alike wherever they are encoded -- a weight shard gathered for
    forward and again for backward (:mod:`.weights`): seeded by a checksum of their bytes, and the rank."""
    flat = values.detach().reshape(-1).contiguous()
    checksum = zlib.crc32(flat.view(torch.uint8).numpy().tobytes())
    return torch.Generator().manual_seed(checksum ^ (rank * 0x9E3779B1 & 0xFFFFFFFF))


def mean_in_rank_order(codec: Codec, messages, total: torch.Tensor, known: dict | None = None) -> torch.Tensor:
    """The mean of the messages, decoded and added in rank order into ``total`` (zeroed first, its values
    overwritten): what every rank (and the reference) computes, bit for bit.  ``known``: ``{i: decoded}`` for
    messages already decoded (a rank's own, which error feedback decodes anyway), added as they are."""
    total.zero_()
    for i, message in enumerate(messages):
        if known and i in known:
            total += known[i]
        else:
            codec.add_decoded(message, total)
    return total.div_(len(messages))


class GatheredWire(KeepsResiduals, RefusesNonFinite):
    """A codec's wire, with optional error feedback; a stage passes it as ``wire=`` to its all-reduce."""

    def __init__(self, comm: Comm, codec: Codec, error_feedback: bool = False):
        self.comm, self.codec, self.error_feedback = comm, codec, error_feedback
        self.residuals: dict = {}  # key -> what this rank has not yet sent of that buffer
        self.averages: dict = {}  # key -> how many times that buffer was averaged: a stochastic codec's stream
        self.formula_by_kind: dict = {}  # what the ledger should count, by collective: each message to N-1 ranks

    @property
    def wire_dtype(self) -> str:
        """What travels, as a checkpoint records it (a resumed run must use the same codec)."""
        return self.codec.spec()

    @property
    def keeps_state(self) -> bool:
        """The residuals, with error feedback; a stochastic codec's count of each buffer's averages."""
        return self.error_feedback or self.codec.stochastic

    def state_dict(self) -> dict:
        return {"residuals": dict(self.residuals), "averages": dict(self.averages)}

    def load_state_dict(self, state: dict, device) -> None:
        super().load_state_dict(state, device)
        self.averages.update(state.get("averages", {}))  # (saved before the streams were counted: none)

    def average(self, comm, collective, kind: str, arguments: dict, key, tag, layout=None) -> None:
        """An all-reduce: every rank's whole message to every rank (all-gather).  A reduce-scatter (ZeRO's):
        each rank's buffer cut into its N shards, each shard encoded on its own and sent to its owner
        (all-to-all, ZeRO++'s qgZ), so a rank decodes N messages of its shard only."""
        if kind not in ("all_reduce", "reduce_scatter"):
            raise ValueError(f"rank {self.comm.rank}: compress={self.codec.spec()!r} averages with an all-gather or "
                             f"an all-to-all; a {kind} is neither")
        comm.check_copied(kind, arguments, tag)  # its own collectives see only its copies
        n, rank = self.comm.world_size, self.comm.rank
        scatter = kind == "reduce_scatter"
        source, target = (arguments["input"], arguments["output"]) if scatter else (arguments["tensor"],) * 2
        carried = source.reshape(-1).clone()
        self.carry(key, carried, rank)
        flat = carried.cpu()
        pieces = split(flat, n if scatter else 1)  # a reduce-scatter's input is padded to N equal shards
        count = self.averages.get(key, 0)
        self.averages[key] = count + 1
        messages = [self.codec.encode(p, stream(rank, count, j) if self.codec.stochastic else None)
                    for j, p in enumerate(pieces)]
        sent = torch.cat(messages).to(source.device)
        size = pieces[0].numel()
        via = "all_to_all" if scatter else "all_gather"
        self.formula_by_kind[via] = self.formula_by_kind.get(via, 0) + (n - 1) * self.codec.message_bytes(size, carried.dtype)
        received = sent.new_empty(sent.numel() * (1 if scatter else n))
        if scatter:
            self.comm.all_to_all(received, sent, tag=tag)
        else:
            self.comm.all_gather(received, sent, tag=tag)
        known = {}
        if self.error_feedback:  # what this rank's messages will deliver, decoded: the rest is carried (if finite)
            delivered = [self.codec.decode(m, size, p.dtype) for m, p in zip(messages, pieces, strict=True)]
            residual = carried - torch.cat(delivered).to(carried.device)
            known = {rank: delivered[rank if scatter else 0]}  # its own message in the sum: decoded once
        # what was carried is encoded (and its residual taken): the mean is summed in its place, not in a new buffer
        mean = mean_in_rank_order(self.codec, received.cpu().chunk(n), flat[:size], known)
        if not bool(torch.isfinite(mean).all()):  # never written into the weights, the residual kept as it was
            self.refuse_non_finite(f"rank {rank}: inf/NaN in the {self.codec.name} wire's mean of "
                                   f"{(tag.describe() if tag else 'a gradient buffer')}; the weights were not touched")
        elif self.error_feedback:
            self.residuals[key] = residual
        target.reshape(-1).copy_(mean.to(target.device))


def split(flat: torch.Tensor, pieces: int) -> list[torch.Tensor]:
    """``flat`` in ``pieces`` equal parts (its length a multiple of ``pieces``: a padded buffer), empty ones too."""
    size = flat.numel() // pieces
    return [flat[i * size:(i + 1) * size] for i in range(pieces)]

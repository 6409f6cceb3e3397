"""Quantized weights on ZeRO-3's all-gather (ZeRO++'s qwZ, stage ``zeropp``): the parameters travel as int8 codes.

ZeRO-3 all-gathers every unit's parameters twice a step -- two thirds of its bytes.  qwZ (Wang et al. 2023,
Section 3.1) sends each rank's shard as block-quantized codes instead: ``(N-1)·|m|`` bytes per rank per gather,
about a quarter of fp32's at int8.  Every rank -- the shard's owner too -- decodes every shard and computes
forward and backward with the *decoded* weights, so all ranks compute with the same numbers; the optimizer
steps the exact shard each rank owns (the weights themselves are never rounded, only their copies in flight).

So training is no longer single-device training on the exact weights: the gradient is taken at weights
rounded shard by shard.  The reference (:mod:`minizero.course.harness.casts_reference`) computes each rank's gradient at
the same rounded weights, which :func:`round_like_the_gather` gives it, and the equivalence stays tight.
Only the quantized codecs fit: a weight must arrive whole, not as its top-k or its sign.
"""
from __future__ import annotations

import torch

from ..comm import Comm
from .gathered import split, stream_of_values
from .quantized import Quantized


def parse_weights(spec: str | None) -> Quantized | None:
    """``quantized_weights=`` read: None, or an int8/int4 codec."""
    from . import parse  # (the package's registry of codecs; it does not import this module)
    if spec in (None, "none"):
        return None
    codec = parse(spec)
    if not isinstance(codec, Quantized):
        raise ValueError(f"quantized_weights={spec!r}: the weights must arrive whole, so only a quantized codec fits "
                         f"(int8, int4, with block= and stochastic=); not top-k, sign, PowerSGD or a 16-bit dtype")
    return codec


def round_like_the_gather(full: torch.Tensor, codec: Quantized, world_size: int) -> torch.Tensor:
    """What every rank's gather of ``full`` (padded to N shards, shard i from rank i) decodes to."""
    return torch.cat([codec.decode(codec.encode(shard, stream_of_values(i, shard) if codec.stochastic else None),
                                   shard.numel(), shard.dtype) for i, shard in enumerate(split(full, world_size))])


class QuantizedWeights:
    """The all-gather of ZeRO-3's parameter shards over a quantized codec."""

    def __init__(self, comm: Comm, codec: Quantized):
        self.comm, self.codec = comm, codec
        self.formula_by_kind = {"all_gather": 0.0}  # (N-1) messages of every shard gathered

    def all_gather(self, full: torch.Tensor, shard: torch.Tensor, tag) -> None:
        n, rank = self.comm.world_size, self.comm.rank
        on_host = shard.detach().reshape(-1).cpu()
        message = self.codec.encode(on_host, stream_of_values(rank, on_host) if self.codec.stochastic else None)
        gathered = message.new_empty(n * message.numel()).to(shard.device)
        self.comm.all_gather(gathered, message.to(shard.device), tag=tag)
        self.formula_by_kind["all_gather"] += (n - 1) * message.numel()
        full.copy_(torch.cat([self.codec.decode(m.cpu(), shard.numel(), shard.dtype)
                              for m in gathered.chunk(n)]).to(full.device))

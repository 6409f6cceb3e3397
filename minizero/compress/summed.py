"""A wire whose encodings add up: encode, let the plain collective sum the encodings, decode the sum.

The 16-bit wire is one (:mod:`.sixteen_bit`): an fp16 or bf16 number is a number, so N of them sum on the way round
the ring exactly as fp32 numbers would, only in fewer bits.  What travels and is summed is ``encode``'s output; the
sum (or this rank's shard of it, for a reduce-scatter or a push) goes to ``decode``, which writes the mean into the
caller's tensor.  Where the division by N happens -- before the sum, after it, or split around it -- is the
encoding's business.  A codec's messages (int8 with a scale per block, top-k, signs) do not add up, and travel
otherwise (:mod:`.gathered`).
"""
from __future__ import annotations

import torch

from ..comm import ReduceOp, Tag
from .kept import KeepsResiduals
from .overflow import RefusesNonFinite


class SummedWire(KeepsResiduals, RefusesNonFinite):
    """The average through ``encode`` and ``decode``: the one method the communication layer calls
    (:class:`minizero.comm.wire.WireProtocol`)."""

    def encode(self, flat: torch.Tensor, key=None) -> torch.Tensor:
        raise NotImplementedError

    def decode(self, wire: torch.Tensor, out: torch.Tensor, key=None, where: str = "a gradient buffer") -> None:
        raise NotImplementedError

    def average(self, comm, collective, kind: str, arguments: dict, key, tag: Tag | None, layout=None) -> None:
        where = (tag or Tag()).describe()
        if "tensor" in arguments:  # all-reduce: in place
            encoded = self.encode(arguments["tensor"], key)
            collective(comm, **{**arguments, "tensor": encoded, "op": ReduceOp.SUM}, tag=tag)
            self.decode(encoded, arguments["tensor"], key, where)
        else:  # reduce-scatter (or a push): this rank's shard of the mean
            encoded = self.encode(arguments["input"], key)
            shard = encoded.new_empty(arguments["output"].numel())
            collective(comm, **{**arguments, "output": shard, "input": encoded, "op": ReduceOp.SUM}, tag=tag)
            self.decode(shard, arguments["output"], key, where)

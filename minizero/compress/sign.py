"""The one-bit wire: the sign of every value and one scale, the mean magnitude (``sign``).

Each value travels as one bit (1: x >= 0) and the message carries ``mean |x|`` in the gradient's dtype, so
``decode`` returns ``scale * (+1 or -1)``: the l1 norm survives, the direction is the signs.  32x fewer
bytes than fp32 (plus the scale).  Biased -- a gradient of 0.001 and one of 10 both become ±scale -- so it
trains only with error feedback (1-bit SGD, Seide et al. 2014; the compressed all-reduce of 1-bit Adam, Tang
et al. 2021, which also keeps a second error where the chunks are summed; here every rank decodes every message, so there
is one quantization and one error per rank).
"""
from __future__ import annotations

import math

import numpy
import torch

from .codec import Codec, as_bytes, as_numpy, chunks, element_bytes, from_bytes


class Sign(Codec):
    name = "sign"

    def message_bytes(self, numel: int, dtype: torch.dtype) -> int:
        return math.ceil(numel / 8) + element_bytes(dtype)

    def encode(self, x: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
        flat = x.detach().reshape(-1)
        packed = numpy.empty(math.ceil(flat.numel() / 8), dtype=numpy.uint8)
        magnitude = 0.0  # sum |x|: numpy's pairwise sum in each chunk, the chunks' in float64
        for start, stop in chunks(flat.numel(), 8):
            values = as_numpy(flat[start:stop])
            magnitude += float(numpy.abs(values).sum())
            packed[start // 8:math.ceil(stop / 8)] = numpy.packbits(values >= 0, bitorder="little")
        scale = torch.tensor([magnitude / max(1, flat.numel())], dtype=x.dtype)
        return torch.cat([torch.from_numpy(packed), as_bytes(scale)])

    def add_decoded(self, message: torch.Tensor, total: torch.Tensor) -> torch.Tensor:
        numel = total.numel()
        nbytes = math.ceil(numel / 8)
        scale = from_bytes(message[nbytes:], total.dtype)
        values = SIGNS.to(total.dtype) * scale  # byte b -> its 8 values, +scale or -scale: one lookup a byte
        for start, stop in chunks(numel, 8):
            decoded = values.index_select(0, message[start // 8:math.ceil(stop / 8)].to(torch.int32))
            total[start:stop] += decoded.view(-1)[:stop - start]
        return total


#: Bit j of byte b (numpy's ``bitorder="little"``) is value j's sign: +1 where it is set, -1 where not.
SIGNS = ((torch.arange(256)[:, None] >> torch.arange(8)) & 1) * 2.0 - 1

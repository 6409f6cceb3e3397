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

import torch

from .codec import Codec, as_bytes, element_bytes, from_bytes


class Sign(Codec):
    name = "sign"

    def message_bytes(self, numel: int, dtype: torch.dtype) -> int:
        return math.ceil(numel / 8) + element_bytes(dtype)

    def encode(self, x: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
        flat = x.detach().reshape(-1)
        scale = flat.abs().mean().reshape(1)
        bits = (flat >= 0).to(torch.uint8)
        bits = torch.cat([bits, bits.new_zeros((-bits.numel()) % 8)]).view(-1, 8)
        weights = torch.tensor([1, 2, 4, 8, 16, 32, 64, 128], dtype=torch.uint8)
        packed = (bits * weights).sum(dim=1, dtype=torch.uint8)  # no carries: each bit has its own weight
        return torch.cat([packed, as_bytes(scale)])

    def decode(self, message: torch.Tensor, numel: int, dtype: torch.dtype) -> torch.Tensor:
        nbytes = math.ceil(numel / 8)
        scale = from_bytes(message[nbytes:], dtype)
        bits = (message[:nbytes, None] >> torch.arange(8, dtype=torch.uint8)) & 1
        signs = bits.reshape(-1)[:numel].to(dtype) * 2 - 1
        return signs * scale

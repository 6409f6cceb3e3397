"""The sparse wire: the ``k`` largest gradient values by magnitude, as index/value pairs (``topk:0.01``).

A rank sends ``k = ceil(fraction * numel)`` pairs -- a 4-byte index and the value in the gradient's own dtype
-- and every rank scatters what each sent into zeros and adds them up.  The ranks choose *different*
indices, so the union grows with N: the all-gather carries N·k pairs, not k (why Deep Gradient Compression,
Lin et al. 2018, counts its savings per rank, and why sparse all-reduce stops paying at large N).  What is
not sent is lost unless error feedback carries it to the next step (``error_feedback=True``): without it
top-k at 1% drops 99% of every gradient, forever.
"""
from __future__ import annotations

import math

import torch

from .codec import Codec, as_bytes, element_bytes, from_bytes, parse_arguments


class TopK(Codec):
    name = "topk"

    def __init__(self, fraction: float = 0.01):
        if not 0 < fraction <= 1:
            raise ValueError(f"topk keeps a fraction of each gradient in (0, 1]; got {fraction}")
        self.fraction = fraction

    @classmethod
    def from_spec(cls, text: str) -> "TopK":
        return cls(**parse_arguments("topk", text, {"fraction": float}, first="fraction"))

    def spec(self) -> str:
        return f"topk:{self.fraction:g}"

    def k(self, numel: int) -> int:
        return min(numel, max(1, math.ceil(self.fraction * numel)))

    def message_bytes(self, numel: int, dtype: torch.dtype) -> int:
        return self.k(numel) * (4 + element_bytes(dtype))

    def encode(self, x: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
        flat = x.detach().reshape(-1)
        # Sorted indices: the message does not depend on how topk orders its ties among the chosen.
        index = torch.topk(flat.abs(), self.k(flat.numel()), sorted=False).indices.sort().values
        return torch.cat([as_bytes(index.to(torch.int32)), as_bytes(flat[index])])

    def decode(self, message: torch.Tensor, numel: int, dtype: torch.dtype) -> torch.Tensor:
        k = self.k(numel)
        index = from_bytes(message[:4 * k], torch.int32).to(torch.int64)
        out = torch.zeros(numel, dtype=dtype)
        out[index] = from_bytes(message[4 * k:], dtype)
        return out

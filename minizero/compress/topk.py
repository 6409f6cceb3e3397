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

import numpy
import torch

from .codec import Codec, as_bytes, as_numpy, chunks, element_bytes, from_bytes, parse_arguments


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
        index = largest(flat, self.k(flat.numel()))
        return torch.cat([as_bytes(index.to(torch.int32)), as_bytes(flat[index])])

    def add_decoded(self, message: torch.Tensor, total: torch.Tensor) -> torch.Tensor:
        k = self.k(total.numel())
        index = from_bytes(message[:4 * k], torch.int32).to(torch.int64)
        return total.index_add_(0, index, from_bytes(message[4 * k:], total.dtype))  # the indices are distinct


#: Values drawn to estimate the k-th largest magnitude.
SAMPLE = 1 << 14


def largest(flat: torch.Tensor, k: int) -> torch.Tensor:
    """The indices of ``flat``'s ``k`` largest magnitudes (NaN counts as largest, as in ``torch.topk``), sorted --
    so the message does not depend on how ``topk`` orders what it chose.

    ``topk`` over 10M values takes 300 ms on a CPU.  So a strided sample's magnitudes set a threshold below
    the k-th largest (twice the sample's share of k, and more): the values at or above it -- a few k -- are the
    candidates, and ``topk`` runs on those.  Were fewer than k at or above it (a sample that missed where the
    large values are), every value is a candidate: the answer is exact either way, only its time varies."""
    if 4 * k >= flat.numel():
        return torch.topk(flat.abs(), k, sorted=False).indices.sort().values
    sample = flat[::max(1, flat.numel() // SAMPLE)].abs()
    kept = min(sample.numel(), 2 * math.ceil(k * sample.numel() / flat.numel()) + 8)
    threshold = float(torch.topk(sample, kept, sorted=False).values.min())
    if not threshold > 0:  # a gradient mostly zeros: every value would be a candidate, indices and all
        return torch.topk(flat.abs(), k, sorted=False).indices.sort().values
    found = []
    for start, stop in chunks(flat.numel()):
        values = as_numpy(flat[start:stop])
        found.append(torch.from_numpy(numpy.flatnonzero(~(numpy.abs(values) < threshold))) + start)  # NaN is in
    candidates = torch.cat(found)
    if candidates.numel() < k:
        candidates = torch.arange(flat.numel())
    chosen = torch.topk(flat[candidates].abs(), k, sorted=False).indices
    return candidates[chosen].sort().values

"""The 8-bit float wire: ``fp8`` -- each value an FP8 number, with one float32 scale per block.

FP8 (Micikevicius et al. 2022, "FP8 Formats for Deep Learning", arXiv:2209.05433) has two formats: **E4M3** (4
exponent bits, 3 mantissa bits, largest 448) and **E5M2** (5 and 2, largest 57344); their recipe scales a tensor so
its largest value lands near the format's largest, and uses E5M2 for gradients, whose range is wider.  Here the
scale is per block of ``block`` values, as int8's is (:mod:`.quantized`), and the format a setting
(``fp8:format=e5m2``); torch's own dtypes (``torch.float8_e4m3fn``, ``torch.float8_e5m2``) do the rounding, to
nearest, on a CPU too.

The same bytes as int8 -- one per value and four per block -- spent otherwise.  An int8 code has the same
*absolute* step everywhere in its block (max/127): a value under max/254 rounds to zero.  An FP8 code has the same
*relative* error, at most 2^-4 of the value for E4M3 (half its last place, 3 mantissa bits), from the block's max
down to 1/28,672 of it (E4M3's normal numbers, 2^-6 to 448); below that its subnormals' step is fixed, and a value
under 2^-10 of the max/448 rounds to zero.  E5M2 reaches a billionth of the max with one mantissa bit less.  So the
small gradients of a block with one large value keep a digit instead of none.  Rounding to nearest is biased:
error feedback carries what was lost.
"""
from __future__ import annotations

import math

import torch

from .codec import Codec, as_bytes, chunks, from_bytes, parse_arguments
from .quantized import scaled, whole_blocks

FORMATS = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}


class Float8(Codec):
    name = "fp8"

    def __init__(self, format: str = "e4m3", block: int = 256):
        if format not in FORMATS:
            raise ValueError(f"compress=fp8: format={format!r}; the formats are {', '.join(FORMATS)}")
        if block < 1:
            raise ValueError(f"block must be at least 1 value per scale; got {block}")
        self.format, self.block, self.dtype = format, block, FORMATS[format]
        self.largest = torch.finfo(self.dtype).max

    @classmethod
    def from_spec(cls, text: str) -> "Float8":
        return cls(**parse_arguments("fp8", text, {"format": str, "block": int}, first="format"))

    def spec(self) -> str:
        return f"fp8:format={self.format},block={self.block}"

    def message_bytes(self, numel: int, dtype: torch.dtype) -> int:
        return numel + 4 * math.ceil(numel / self.block)

    def encode(self, x: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
        flat = x.detach().reshape(-1)
        numel = flat.numel()
        codes = torch.empty(numel, dtype=torch.uint8)
        scale = torch.empty(math.ceil(numel / self.block), dtype=torch.float32)
        work = torch.float64 if flat.dtype == torch.float64 else torch.float32
        for start, stop in chunks(numel, self.block):
            rows = whole_blocks(flat[start:stop].to(work), self.block)
            units, block_scale = scaled(rows, rows.abs().amax(dim=1), self.largest)  # the block's max -> the largest
            scale[start // self.block:start // self.block + rows.shape[0]] = block_scale
            units.clamp_(-self.largest, self.largest)  # a float32 scale rounded down could put the max a hair past
            codes[start:stop] = units.to(self.dtype).view(-1)[:stop - start].view(torch.uint8)
        return torch.cat([codes, as_bytes(scale)])

    def add_decoded(self, message: torch.Tensor, total: torch.Tensor) -> torch.Tensor:
        numel = total.numel()
        codes, scale = message[:numel], from_bytes(message[numel:], torch.float32)
        # an FP8 value (at most 4 significant bits) times a float32 scale is exact in float64: rounded once, to
        # the gradient's dtype, as int8's decoding is
        exact = total.dtype if total.dtype == torch.float64 else torch.float64
        for start, stop in chunks(numel, self.block):
            rows = whole_blocks(codes[start:stop].view(self.dtype).to(exact), self.block)
            block_scale = scale[start // self.block:start // self.block + rows.shape[0]].to(exact)
            total[start:stop] += rows.mul_(block_scale[:, None]).view(-1)[:stop - start].to(total.dtype)
        return total

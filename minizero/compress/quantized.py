"""The quantized wire: ``int8`` and ``int4`` codes with one scale per block.

Each block of ``block`` values is sent as ``bits``-bit integers in [-(2^(b-1)-1), 2^(b-1)-1] and one
float32 scale, ``max|x| / (2^(b-1)-1)``: per block, so one large gradient spoils only its own block's
resolution (torch's ``quantization_perchannel_hook`` scales per row, ZeRO++'s qgZ per block).  Rounding to
nearest is biased for values that sit between codes; with ``stochastic`` (QSGD, Alistarh et al. 2017) a value
rounds up with probability equal to its distance from the code below, so E[x̂] = x and no error feedback is
needed for the mean to be right -- ``tests/test_codecs.py`` checks that with a test that can fail.
"""
from __future__ import annotations

import math

import torch

from .codec import Codec, as_bytes, from_bytes, parse_arguments


class Quantized(Codec):
    def __init__(self, bits: int = 8, block: int = 256, stochastic: bool = False):
        if bits not in (4, 8):
            raise ValueError(f"the quantized wire sends 8 or 4 bits per value; got bits={bits}")
        if block < 1:
            raise ValueError(f"block must be at least 1 value per scale; got {block}")
        self.bits, self.block, self.stochastic = bits, block, stochastic
        self.unbiased = stochastic
        self.levels = (1 << (bits - 1)) - 1  # 127 or 7: symmetric, so 0 is exact
        self.name = f"int{bits}"

    @classmethod
    def from_spec(cls, bits: int, text: str) -> "Quantized":
        return cls(bits, **parse_arguments(f"int{bits}", text, {"block": int, "stochastic": bool}, first="block"))

    def spec(self) -> str:
        return f"{self.name}:block={self.block}" + (",stochastic=1" if self.stochastic else "")

    def _blocks(self, numel: int) -> int:
        return math.ceil(numel / self.block)

    def message_bytes(self, numel: int, dtype: torch.dtype) -> int:
        return math.ceil(numel * self.bits / 8) + 4 * self._blocks(numel)

    def encode(self, x: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
        numel, blocks = x.numel(), self._blocks(x.numel())
        padded = torch.zeros(blocks * self.block, dtype=torch.float64)
        padded[:numel] = x.detach().reshape(-1).to(torch.float64)
        rows = padded.view(blocks, self.block)
        scale = (rows.abs().amax(dim=1) / self.levels).to(torch.float32)
        safe = torch.where(scale > 0, scale, torch.ones_like(scale)).to(torch.float64)
        units = rows / safe[:, None]  # in [-levels, levels]
        if self.stochastic:
            low = units.floor()
            up = torch.rand(units.shape, dtype=torch.float64, generator=generator) < (units - low)
            codes = low + up.to(torch.float64)
        else:
            codes = units.round()
        codes = codes.clamp(-self.levels, self.levels).to(torch.int8).view(-1)[:numel]
        if self.bits == 4:  # two codes per byte, offset to 0..14
            nibbles = (codes + self.levels).to(torch.uint8)
            if numel % 2:
                nibbles = torch.cat([nibbles, nibbles.new_zeros(1)])
            packed = nibbles[0::2] | (nibbles[1::2] << 4)
        else:
            packed = codes.view(torch.uint8)
        return torch.cat([packed, as_bytes(scale)])

    def decode(self, message: torch.Tensor, numel: int, dtype: torch.dtype) -> torch.Tensor:
        code_bytes = math.ceil(numel * self.bits / 8)
        packed, scale = message[:code_bytes], from_bytes(message[code_bytes:], torch.float32)
        if self.bits == 4:
            nibbles = torch.stack([packed & 0xF, packed >> 4], dim=1).view(-1)[:numel]
            codes = nibbles.to(torch.float64) - self.levels
        else:
            codes = packed.clone().view(torch.int8).to(torch.float64)
        per_value = scale.to(torch.float64).repeat_interleave(self.block)[:numel]
        return (codes * per_value).to(dtype)

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

from .codec import Codec, as_bytes, chunks, from_bytes, parse_arguments


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

    def _step(self) -> int:
        """Values per chunk: whole blocks, and an even number of values (int4 packs two to a byte)."""
        return self.block * (2 if self.bits == 4 and self.block % 2 else 1)

    def encode(self, x: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
        flat = x.detach().reshape(-1)
        numel, code_bytes = flat.numel(), math.ceil(flat.numel() * self.bits / 8)
        packed = torch.empty(code_bytes, dtype=torch.uint8)
        scale = torch.empty(self._blocks(numel), dtype=torch.float32)
        work = torch.float64 if flat.dtype == torch.float64 else torch.float32  # a 16-bit gradient's values exactly
        for start, stop in chunks(numel, self._step()):
            rows = whole_blocks(flat[start:stop].to(work), self.block)
            units, block_scale = scaled(rows, torch.maximum(rows.amax(dim=1), rows.amin(dim=1).neg()), self.levels)
            scale[start // self.block:start // self.block + rows.shape[0]] = block_scale  # units in [-levels, levels]
            if self.stochastic:  # rounded up with probability the distance from the code below
                low = units.floor()
                units = low.add_(torch.rand(units.shape, dtype=work, generator=generator) < (units - low))
            codes = units.round_().clamp_(-self.levels, self.levels).to(torch.int8).view(-1)[:stop - start]
            if self.bits == 4:  # two codes per byte, offset to 0..14
                nibbles = (codes + self.levels).to(torch.uint8)
                nibbles = torch.cat([nibbles, nibbles.new_zeros(nibbles.numel() % 2)])
                packed[start // 2:start // 2 + nibbles.numel() // 2] = nibbles[0::2] | (nibbles[1::2] << 4)
            else:
                packed[start:stop] = codes.view(torch.uint8)
        return torch.cat([packed, as_bytes(scale)])

    def add_decoded(self, message: torch.Tensor, total: torch.Tensor) -> torch.Tensor:
        numel = total.numel()
        code_bytes = math.ceil(numel * self.bits / 8)
        packed, scale = message[:code_bytes], from_bytes(message[code_bytes:], torch.float32)
        # code x scale is exact in float64 and rounded once -- as a float32 product is (correctly rounded); a
        # 16-bit gradient's would be rounded twice through float32, so it is formed in float64
        exact = total.dtype if total.dtype in (torch.float32, torch.float64) else torch.float64
        for start, stop in chunks(numel, self._step()):
            if self.bits == 4:
                byte = packed[start // 2:(stop + 1) // 2].to(torch.int32)  # one lookup a byte: its two codes
                codes = PAIRS.index_select(0, byte).view(torch.int8)[:stop - start].to(exact)
            else:
                codes = packed[start:stop].view(torch.int8).to(exact)
            rows = whole_blocks(codes, self.block)
            block_scale = scale[start // self.block:start // self.block + rows.shape[0]].to(exact)
            total[start:stop] += rows.mul_(block_scale[:, None]).view(-1)[:stop - start].to(total.dtype)
        return total


def scaled(rows: torch.Tensor, magnitude: torch.Tensor, top: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Each block (a row) in units of its scale, and the scales: ``magnitude / top`` as sent, in float32, so the
    block's largest magnitude lands on the code ``top`` (an all-zero block is divided by 1)."""
    scale = (magnitude / top).to(torch.float32)
    safe = torch.where(scale > 0, scale, torch.ones_like(scale)).to(rows.dtype)
    return rows / safe[:, None], scale


def whole_blocks(values: torch.Tensor, block: int) -> torch.Tensor:
    """``values`` as rows of ``block``, the last one padded with zeros (which change no block's max)."""
    if values.numel() % block:
        values = torch.cat([values, values.new_zeros(-values.numel() % block)])
    return values.view(-1, block)


#: Byte b of an int4 message -> its two codes (the low nibble's first), back from 0..14 to -7..7: two int8 seen as
#: one int16, so a lookup moves 2-byte rows (3x faster than rows of two floats); read back as int8, byte for byte.
PAIRS = torch.stack([torch.arange(256) & 0xF, torch.arange(256) >> 4], dim=1).sub(7).to(torch.int8).view(torch.int16).view(-1)

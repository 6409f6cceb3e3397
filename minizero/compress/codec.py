"""What a compressor is: a codec that turns one rank's flat gradient into a message of bytes and back.

The 16-bit wire (:mod:`.sixteen_bit`) is special: its messages can be *summed* on the way, so it rides inside
the ring all-reduce.  Narrower formats cannot: two int8 codes with different scales, two top-k index lists, two
sign vectors do not add.  So each rank sends its message whole and every rank decodes all of them and adds
the decoded gradients (:mod:`.gathered`) -- what torch's ``quantization_pertensor_hook`` does, and the price
is an all-gather, whose bytes grow with N where the ring's do not.

A codec is three pure functions of one tensor, so the reference (:mod:`minizero.course.harness.casts_reference`) can
apply *the same* compression to the same per-rank gradients and the equivalence stays tight: the proof is of
the distribution (which buffer, which residual, which order, which division); the codec's own promises --
error bounds, unbiasedness, the k kept -- are tested on the codec alone (``tests/test_codecs.py``).
"""
from __future__ import annotations

import torch

#: Codecs walk a buffer this many values at a time.  A temporary the size of a whole gradient is fresh memory on
#: every call -- on a CPU, 28 ms of page faults for a 10M-value buffer before any arithmetic, more than the
#: arithmetic itself -- while one of a megabyte is handed back by the allocator call after call, and a few
#: hundred chunks cost little in Python (fastest on the medium GPT's 10.7M values, measured from 2^15 to 2^20;
#: issue 48).
CHUNK = 1 << 18


def chunks(numel: int, multiple: int = 1):
    """``(start, stop)`` of each chunk of a ``numel``-value buffer: :data:`CHUNK` values, rounded to a
    ``multiple`` (a codec's block, 8 values to a byte) so that no block or byte is cut in two."""
    step = multiple * max(1, CHUNK // multiple)
    return ((start, min(start + step, numel)) for start in range(0, numel, step))


class Codec:
    """``encode(x) -> message`` (uint8, ``message_bytes(x.numel(), x.dtype)`` long), ``decode(message, numel,
    dtype) -> x̂``.  ``unbiased``: E[decode(encode(x))] = x (stochastic rounding), so no error feedback is
    needed for the mean to be right; a biased codec (top-k, sign, nearest rounding) needs it to lose nothing.

    Tensors on the CPU (the wires bring a message there to code it).  A codec writes ``add_decoded(message,
    total)`` -- ``total += x̂``, value for value -- and ``decode`` is that into zeros: a wire sums N ranks'
    messages into one buffer without a decoded copy of each (the sum in rank order,
    :func:`~minizero.compress.gathered.mean_in_rank_order`, is bit for bit the same)."""
    name = "codec"
    unbiased = False
    stochastic = False  # encode draws random numbers (from the generator it is given)

    def encode(self, x: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
        raise NotImplementedError

    def add_decoded(self, message: torch.Tensor, total: torch.Tensor) -> torch.Tensor:
        """``total += decode(message)`` in place (``total`` flat, of the encoded tensor's length and dtype)."""
        raise NotImplementedError

    def decode(self, message: torch.Tensor, numel: int, dtype: torch.dtype) -> torch.Tensor:
        return self.add_decoded(message, torch.zeros(numel, dtype=dtype))

    def message_bytes(self, numel: int, dtype: torch.dtype) -> int:
        raise NotImplementedError

    def spec(self) -> str:
        """The ``compress=`` text that builds this codec again."""
        return self.name


def as_numpy(piece: torch.Tensor):
    """``piece`` as a numpy array, for the compares numpy runs 4-7x faster than torch on a CPU: a 16-bit one
    through float32, exactly (numpy has no bfloat16)."""
    return (piece if piece.dtype in (torch.float32, torch.float64) else piece.float()).numpy()


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """A tensor's bytes, flat: how a message carries values of another dtype."""
    return t.contiguous().view(-1).view(torch.uint8)


def from_bytes(b: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``as_bytes`` undone (a copy: a slice of a message need not be aligned for ``dtype``)."""
    return b.clone().view(dtype)


def element_bytes(dtype: torch.dtype) -> int:
    return torch.empty(0, dtype=dtype).element_size()


#: The words a switch in a spec may be written with; anything else is refused -- read loosely, ``stochastic=on``
#: once built nearest rounding while the spec was echoed as given (issue 46).
SWITCHES = {"1": True, "true": True, "yes": True, "on": True, "0": False, "false": False, "no": False, "off": False}


def switch(value: str) -> bool:
    """``"on"`` -> True, ``"0"`` -> False; a word not in :data:`SWITCHES` is refused."""
    if value.lower() not in SWITCHES:
        raise ValueError(value)
    return SWITCHES[value.lower()]


def parse_arguments(name: str, text: str, allowed: dict[str, type], first: str | None = None) -> dict:
    """``"0.01"`` or ``"rank=4,stochastic=1"`` after ``name:``: a bare first value is ``first``'s."""
    out = {}
    for i, item in enumerate(filter(None, text.split(","))):
        key, _, value = item.partition("=")
        if not _:
            key, value = first, item
            if key is None or i:
                raise ValueError(f"compress={name}:{text}: {item!r} needs a name (one of {', '.join(allowed)})")
        if key not in allowed:
            raise ValueError(f"compress={name}:{text}: unknown setting {key!r}; {name} takes {', '.join(allowed)}")
        try:
            out[key] = allowed[key](value) if allowed[key] is not bool else switch(value)
        except ValueError:
            kind = "switch (1/0, true/false, yes/no, on/off)" if allowed[key] is bool else allowed[key].__name__
            raise ValueError(f"compress={name}:{text}: {key}={value!r} is not a {kind}") from None
    return out

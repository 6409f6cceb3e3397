"""Lab 6 -- accumulation with ``no_sync()``, and the 16-bit wire (lessons/06_accumulation_and_compression.ipynb).

Contract level: each method states what must hold after it runs and what the checker holds it to -- not how.
(The guided level says which parts of minizero exist for it: ``python -m minizero lab compress FILE --level guided``.)

You write ``DDP.no_sync`` (gradient accumulation: K micro-batches, one synchronisation) and the 16-bit wire's
``Wire.encode`` and ``Wire.decode`` (gradients averaged in fp16 or bf16: half the bytes).  Your bases,
``minizero.course.labs.given``'s ``CompressDDP`` and ``Wire``, are the package's DDP and wire without them.  The DDP
averages each flat gradient buffer once per synchronising backward -- over the wire when compression is on
(``compress="fp16"`` or ``"bf16"``), which it builds from its ``wire_class``: keep that your ``Wire``.  An average
over a wire sums, over the ranks, what ``encode`` returns, in the wire's dtype, and hands the sum to ``decode``.

The state the contract speaks of:
  * ``DDP.require_backward_grad_sync`` (torch's name): read by the stage at each forward -- True: that forward's
    backward synchronises (averages the gradients when it has finished); False: it only accumulates them;
  * ``Wire.wire_dtype`` (torch.float16 or torch.bfloat16); ``Wire.pre`` and ``Wire.post``: the division by N split
    around the sum (``pre`` the largest power of two <= sqrt(N), ``post = N / pre``): dividing by ``pre`` before
    the sum keeps the sum of N fp16 values under fp16's 65504, and a power of two divides exactly.

The checker's properties, in order:
  1. your methods are what runs: all three are defined in this file and called during a step (with
     compress="fp16", K = 2);
  2. equivalence to single-device training (no compression): world sizes 1-4, K = 1-3 micro-batches -- the
     loop runs the first K-1 inside ``no_sync()`` -- uneven batches, SGD/momentum/Adam, float64 and float32, the
     edge model;
  3. one all-reduce per optimizer step, whatever K: the bytes of K = 1 and K = 3 (N = 3) are both one ring
     all-reduce of every gradient, 2(N-1)/N x Psi x b;
  4. equivalence to a reference that applies the same casts, in the same order, on fp16 and bf16 wires;
  5. bytes on the 16-bit wire: half of fp32's (b = 2).

Check it:   python -m minizero check compress --impl THIS_FILE
"""
from __future__ import annotations

from contextlib import contextmanager

import torch

from minizero.course.labs.given import CompressDDP as GivenDDP
from minizero.course.labs.given import Wire as GivenWire


class Wire(GivenWire):
    def encode(self, flat: torch.Tensor, key=None) -> torch.Tensor:
        """``flat``: one rank's gradient buffer (fp32 or fp64), left as it is.  Returns what travels: a new tensor
        of ``self.wire_dtype``, equal bit for bit to ``flat`` divided by ``self.pre`` in ``flat``'s dtype, then
        rounded once to the wire's dtype (the reference does exactly these steps: the division first, exact,
        so the cast stays the one rounding before the sum).  ``key`` names the buffer (for error feedback,
        which this wire does not have)."""
        raise NotImplementedError("write Wire.encode: flat / pre, rounded once to the wire dtype")

    def decode(self, wire: torch.Tensor, out: torch.Tensor, key=None, where: str = "a gradient buffer") -> None:
        """``wire``: the sum over ranks of what :meth:`encode` returned, in the wire's dtype.  After it, in place:
        ``out`` (the buffer's own tensor, its dtype) holds, bit for bit, ``wire`` converted to ``out``'s dtype and
        then divided by ``self.post`` there -- the mean over ranks.  (``where`` names the buffer, for an error
        message: the package's wire refuses an inf or NaN; the checker's examples never overflow.)"""
        raise NotImplementedError("write Wire.decode: out = the sum, in out's dtype, / post")


class DDP(GivenDDP):
    wire_class = Wire  # the stage builds its compressed wire from this class: yours

    @contextmanager
    def no_sync(self):
        """A context manager (torch DDP's idiom: ``with model.no_sync(): loss.backward()``).  A forward inside the
        block is followed by a backward that synchronises nothing -- no collective, the gradients accumulate
        locally -- and the first backward outside averages the accumulated sums.  On leaving the block -- also
        when the block raises, and when blocks nest -- ``require_backward_grad_sync`` is what it was on entering.
        Cost: K micro-batches, one all-reduce per optimizer step."""
        raise NotImplementedError("write DDP.no_sync: no synchronisation inside the block")
        yield

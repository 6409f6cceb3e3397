"""Lab 6 -- accumulation with ``no_sync()``, and the 16-bit wire (lessons/06_accumulation_and_compression.ipynb).
Guided level: each method says what to do and which parts exist; the contract level states only what must hold.

Given: DDP, whose ``post_backward`` averages each flat gradient buffer over the
stage's wire, and your wire's attributes: ``self.pre`` (a power of two <= sqrt(N))
and ``self.post`` (N / pre) -- the division by N split around the sum -- and
``self.wire_dtype`` (fp16 or bf16).  An average given a wire runs on what
``wire.encode`` returns -- summed over ranks in 16 bits -- and hands the sum to
``wire.decode``.
Yours: ``DDP.no_sync``, ``Wire.encode`` and ``Wire.decode``.

Check it:   python -m minizero check compress --impl THIS_FILE
The checker trains with K = 1-3 micro-batches and counts the bytes (one
all-reduce per optimizer step, whatever K); then it trains with compress="fp16"
and "bf16" against a single-device reference that applies the same casts in the
same order, and counts half the bytes.
"""
from __future__ import annotations

from contextlib import contextmanager

import torch

from minizero.course.labs.given import CompressDDP as GivenDDP
from minizero.course.labs.given import Wire as GivenWire


class Wire(GivenWire):
    def encode(self, flat: torch.Tensor, key=None) -> torch.Tensor:
        """What travels for ``flat`` (fp32 or fp64): a new tensor in ``self.wire_dtype``, ready to be summed.

        Divide by ``self.pre`` *before* the cast, in ``flat``'s own dtype (a power of two: exact), so that the
        sum of N 16-bit values cannot overflow fp16's 65504; then cast -- the one rounding before the sum.
        Leave ``flat`` as it is.  (torch's ``fp16_compress_hook`` casts first and divides the 16-bit value; the
        reference here divides first, so do the steps in this order.  ``key`` names the buffer, for error
        feedback, which the lab's wire does not have.)
        """
        raise NotImplementedError("write Wire.encode: divide by pre, then cast to the 16-bit wire dtype")

    def decode(self, wire: torch.Tensor, out: torch.Tensor, key=None, where: str = "a gradient buffer") -> None:
        """``wire`` is the 16-bit sum over ranks of what :meth:`encode` returned; leave the mean in ``out``, in place.

        Back to ``out``'s dtype first, then the rest of the division (``self.post``) there, then into ``out``.
        (The package's wire also refuses an inf or NaN here, naming ``where``, before anything is written; the
        lab's examples never overflow.)
        """
        raise NotImplementedError("write Wire.decode: cast the sum back, divide by post, copy it into out")


class DDP(GivenDDP):
    wire_class = Wire  # the stage builds its compressed wire from this class: yours

    @contextmanager
    def no_sync(self):
        """Inside the block, backward accumulates gradients locally and sends nothing; the first backward after
        it averages the accumulated sums (torch DDP's idiom: ``with model.no_sync(): loss.backward()``).

        The stage decides at each forward whether that forward's backward synchronises from a flag with torch's
        own name, ``self.require_backward_grad_sync``.  Turn it off for the block, and afterwards put back what
        it was before -- blocks may nest -- also when the block raises.
        """
        raise NotImplementedError("write DDP.no_sync: turn require_backward_grad_sync off for the block")
        yield

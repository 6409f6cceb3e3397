"""Lab 4 -- accumulation with ``no_sync()``, and the 16-bit wire (lessons/04_accumulation_and_compression.ipynb).

Given: DDP (lab 2's answer: ``post_backward`` all-reduces each flat buffer with
``self.comm.all_reduce(flat, ReduceOp.AVG, ..., wire=self.wire, key=dtype)``) and,
from ``minizero.compress.Wire``, the split of the division by N into ``self.pre``
(a power of two <= sqrt(N)) and ``self.post`` (N / pre), and ``self.wire_dtype``
(fp16 or bf16).  An all-reduce given a wire runs on what ``wire.encode`` returns
-- summed over ranks in 16 bits -- and hands the sum to ``wire.decode``.
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

from minizero.labs.given import CompressDDP as GivenDDP
from minizero.labs.given import Wire as GivenWire


class Wire(GivenWire):
    def encode(self, flat: torch.Tensor, key=None) -> torch.Tensor:
        """What travels for ``flat`` (fp32 or fp64): return it in ``self.wire_dtype``, ready to be summed.

        1. divide by ``self.pre`` *before* casting, in ``flat``'s own dtype (a power of two: exact), so the sum of
           N 16-bit values cannot overflow fp16's 65504;
        2. cast to ``self.wire_dtype`` -- the one rounding before the sum -- and return that (a new tensor:
           leave ``flat`` as it is).
        (torch's ``fp16_compress_hook`` casts first and divides the 16-bit value by N; the reference here applies
        exactly the steps above, so do them in this order.  ``key`` names the buffer: the package's wire keeps
        its rounding error under it with error feedback; the lab's wire has none.)
        """
        raise NotImplementedError("write Wire.encode: divide by pre, then cast to the 16-bit wire dtype")

    def decode(self, wire: torch.Tensor, out: torch.Tensor, key=None, where: str = "a gradient buffer") -> None:
        """``wire`` is the 16-bit sum over ranks of what :meth:`encode` returned; leave the mean in ``out``.

        Cast it back to ``out``'s dtype, divide by ``self.post`` there, and copy into ``out`` (in place:
        ``out.copy_(...)``).  (The package's wire also refuses an inf or NaN here, naming ``where``, before
        anything is written; the lab's examples never overflow.)
        """
        raise NotImplementedError("write Wire.decode: cast the sum back, divide by post, copy it into out")


class DDP(GivenDDP):
    wire_class = Wire  # the stage builds its compressed wire from this class: yours

    @contextmanager
    def no_sync(self):
        """Inside the block, backward accumulates gradients locally and sends nothing; the first backward after
        it averages the accumulated sums (torch DDP's idiom: ``with model.no_sync(): loss.backward()``).

        The stage decides at each forward whether that forward's backward synchronises -- whether
        ``post_backward`` runs after it -- from ``self.require_backward_grad_sync`` (torch's own name).  Set it
        to False for the block and put back what it was afterwards -- also when the block raises.
        """
        raise NotImplementedError("write DDP.no_sync: turn require_backward_grad_sync off for the block")
        yield

"""A filled-in skeleton, written from its docstrings alone (tests/test_labs.py checks it passes).

Lab 4 -- accumulation with ``no_sync()``, and the 16-bit all-reduce (lessons/04_accumulation_and_compression.ipynb).

Given: DDP (lab 2's answer) and, from ``minizero.compress.Wire``, the split of
the division by N into ``self.pre`` (a power of two <= sqrt(N)) and ``self.post``
(N / pre), ``self.wire_dtype`` (fp16 or bf16) and ``self.comm``.
Yours: ``DDP.no_sync`` and ``Wire.all_reduce_mean``.

Check it:   python -m minizero check compress --impl THIS_FILE
The checker trains with K = 1-4 micro-batches and counts the bytes (one
all-reduce per optimizer step, whatever K); then it trains with compress="fp16"
and "bf16" against a single-device reference that applies the same casts in the
same order, and counts half the bytes.
"""
from __future__ import annotations

from contextlib import contextmanager

import torch

from minizero.compress import Wire as GivenWire
from minizero.stages import DDP as GivenDDP


class Wire(GivenWire):
    def all_reduce_mean(self, flat: torch.Tensor, key=None, names=None, tag=None) -> None:
        """Average ``flat`` (fp32 or fp64) over ranks in place, sending it in ``self.wire_dtype``.

        1. divide by ``self.pre`` *before* casting, in ``flat``'s own dtype (a power of two: exact), so the sum of
           N 16-bit values cannot overflow fp16's 65504;
        2. cast to ``self.wire_dtype`` -- the one rounding before the sum;
        3. all-reduce the 16-bit tensor: ``self.comm.all_reduce(wire, ReduceOp.SUM, tag=tag)``;
        4. cast back to ``flat``'s dtype, divide by ``self.post`` there, and copy into ``flat``.
        (torch's ``fp16_compress_hook`` casts first and divides the 16-bit sum by N; the reference here applies
        exactly the steps above, so do them in this order.)
        """
        from minizero.comm import ReduceOp
        wire = (flat / self.pre).to(self.wire_dtype)
        self.comm.all_reduce(wire, ReduceOp.SUM, tag=tag)
        flat.copy_(wire.to(flat.dtype).div_(self.post))


class DDP(GivenDDP):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        if self.wire is not None:  # your wire instead of the package's
            self.wire = Wire(self.comm, self.wire.wire_dtype)

    @contextmanager
    def no_sync(self):
        """Inside the block, backward accumulates gradients locally and sends nothing; the first backward after
        it averages the accumulated sums (torch DDP's idiom: ``with model.no_sync(): loss.backward()``).

        The stage decides at each forward whether that forward's backward synchronises, from
        ``self.require_backward_grad_sync`` (torch's own name).  Set it to False for the block and put back what
        it was afterwards -- also when the block raises.
        """
        previous = self.require_backward_grad_sync
        self.require_backward_grad_sync = False
        try:
            yield
        finally:
            self.require_backward_grad_sync = previous

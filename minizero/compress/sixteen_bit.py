"""The 16-bit wire: gradients averaged across ranks in fp16 or bf16 (``compress="fp16"`` or ``"bf16"``).

Compression is a *wire format*, an option of every stage, written once here:
a stage averages over it by passing it to the collective --
``comm.all_reduce(flat, ReduceOp.AVG, tag=..., wire=self.wire, key=index)``,
the same for ``reduce_scatter`` -- and the wire runs the collective on
:meth:`Wire.encode`'s output and hands the sum to :meth:`Wire.decode`
(:mod:`.summed`).  The bytes on the wire halve (the ledger shows it) and the
result lands back in the gradient's own precision.

Where to divide by N.  The sum of N fp16 gradients can overflow (fp16 tops
out at 65504), so part of the division must happen *before* the reduction;
dividing by all of it before (torch's ``fp16_compress_hook`` casts to fp16,
then divides by N in fp16) pushes small gradients into fp16's subnormals,
where they lose bits or vanish.  We divide by ``pre`` = the largest power of
two <= sqrt(N) before the cast and by ``post = N / pre`` after the sum.  FSDP2
splits the division too, but its fp16 ``pre`` is the power of two reached by
doubling while ``N / pre > pre`` (twice ours at N = 2, 8, 32, ...), applied
after the cast.  A power of two has a second virtue: dividing by it
is exact in binary, so the cast to 16 bits stays the only rounding before
the sum -- which is what makes compressed runs reproducible bit for bit by a
reference that applies the same casts.

An inf or NaN after the reduction raises, naming the gradients; it is never
written into the weights (on a sharded stage every rank raises together:
:mod:`.overflow`) -- unless fp16 mixed precision's dynamic loss scaling is on,
which skips that step on every rank instead (:mod:`minizero.parts.precision`).
With ``error_feedback`` the rounding error of the cast is kept per buffer and
added back next time, so no gradient is lost for good.  Under mixed precision
the same wire carries the 16-bit gradients, and ``reduce_dtype="fp32"`` is a
wire too, a wider one (:func:`make_wire`).
"""
from __future__ import annotations

import math

import torch

from ..comm import Comm
from .summed import SummedWire

WIRE_DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}


def split_division(world_size: int) -> tuple[int, float]:
    """(pre, post): divide by ``pre`` before the 16-bit sum and by ``post`` after; pre * post = N."""
    pre = 1 << int(math.log2(math.isqrt(world_size))) if world_size > 1 else 1
    return pre, world_size / pre


class Wire(SummedWire):
    """Averages flat gradient buffers over a wire of another dtype -- narrower (compression) or wider
    (fp32 reduction of 16-bit gradients) -- in place."""

    def __init__(self, comm: Comm, wire_dtype: torch.dtype, error_feedback: bool = False,
                 overflow_raises: bool = True):
        self.comm = comm
        self.wire_dtype = wire_dtype
        self.error_feedback = error_feedback
        self.overflow_raises = overflow_raises
        self.pre, self.post = split_division(comm.world_size)
        self.residuals: dict = {}  # key -> rounding error carried to the next step
        self._pending: dict = {}  # residuals of the reduction under way, kept only if it succeeds
        self._unsettled: dict = {}  # with loss scaling: residuals kept only if the step is taken (settle)

    def check_gradient_dtype(self, name: str, dtype: torch.dtype) -> None:
        if dtype not in (torch.float32, torch.float64):
            raise TypeError(f"rank {self.comm.rank}: compression sends gradients in {self.wire_dtype}, which only "
                            f"makes sense for float32/float64 gradients; parameter {name!r} is {dtype}. "
                            f"Turn compression off or keep this parameter in float32.")

    def encode(self, flat: torch.Tensor, key=None) -> torch.Tensor:
        """What travels for ``flat`` (a buffer, named ``key`` for its error feedback): ``flat / pre`` (plus the
        rounding error carried from last time) in the wire's dtype.  The collective sums what travels."""
        # Divide in the wider of the two dtypes: exact for a power of two, so the cast stays the one rounding.
        scaled = flat.to(torch.promote_types(flat.dtype, self.wire_dtype)) / self.pre
        if self.error_feedback:
            residual = self.residuals.get(key)
            if residual is not None:
                if residual.shape != scaled.shape:  # residuals loaded from another layout's buckets
                    raise ValueError(f"rank {self.comm.rank}: the error-feedback residual of bucket {key!r} has "
                                     f"{residual.numel()} elements and the bucket {scaled.numel()}: the checkpoint was "
                                     f"saved with another bucket size; resume with the --bucket-mb it was saved with")
                scaled += residual
        wire = scaled.to(self.wire_dtype)
        if self.error_feedback:
            self._pending[key] = scaled - wire.to(scaled.dtype)
        return wire

    def decode(self, wire: torch.Tensor, out: torch.Tensor, key=None, where: str = "a gradient buffer") -> None:
        """The summed ``wire`` into ``out``, divided by ``post``: the mean, in ``out``'s dtype.  An inf or NaN
        raises (naming ``where``) before anything is written -- unless loss scaling will skip the step."""
        pending = self._pending.pop(key, None)
        # A host synchronisation per bucket -- on the communication thread, not in a backward hook: whether
        # this bucket overflowed decides, before anything is written, to refuse the step or keep the residual.
        finite = bool(torch.isfinite(wire).all())
        if not finite and self.overflow_raises:  # the step is lost; the carried error is not poisoned
            self.refuse_non_finite(
                f"rank {self.comm.rank}: gradients overflowed {self.wire_dtype} in the reduction "
                f"(inf/NaN in {where}); the weights were not touched. "
                f"Lower the loss scale or learning rate, or use compress='bf16' (fp32's range).")
        if pending is not None and not self.overflow_raises:
            self._unsettled[key] = pending  # the step's fate is decided on every rank together: settle()
        elif pending is not None and finite:
            self.residuals[key] = pending
        # Divide in the wider dtype again: a wide wire's mean is rounded into ``out`` once.
        out.copy_(wire.to(torch.promote_types(out.dtype, self.wire_dtype)).div_(self.post))

    def settle(self, stepped: bool, rescale: float = 1.0) -> None:
        """Under dynamic loss scaling: keep this step's residuals if the step was taken on every rank (a
        skipped step's may hold inf - inf), and carry all of them into the next loss scale's units."""
        if stepped:
            self.residuals.update(self._unsettled)
        self._unsettled.clear()
        if rescale != 1.0:
            for residual in self.residuals.values():
                residual.mul_(rescale)



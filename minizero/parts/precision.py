"""Mixed precision, the policy: which dtype the model computes in, which the gradients are reduced in, the loss
scale's settings (ZeRO paper, section 3.1; Micikevicius et al., 2018, "Mixed Precision Training").

The model computes in 16 bits -- a **working copy** of the parameters, 2 bytes each, whose gradients are 16 bits
too -- while the optimizer updates **fp32 master weights**, because an update ``lr * g`` is often smaller than half
a 16-bit ulp of the weight and would round away.  Adam then keeps K = 12 bytes per parameter in fp32: the master
weight (4), the momentum (4) and the variance (4).  Per parameter, 2 + 2 + K = 16 bytes -- the paper's 16Psi.

:class:`Precision` is one option of every stage, like FSDP2's ``MixedPrecisionPolicy``; the masters and the loss
scaler that carry it out are :mod:`minizero.parts.masters`.  bf16 has fp32's exponent range, so it needs no loss
scaling (and gets none, as in torch and DeepSpeed); it keeps 8 significant bits against fp16's 11.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

#: The working (compute) dtype of each precision; fp32 means "no mixed precision".
PRECISIONS = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}
REDUCE_DTYPES = {"fp32": torch.float32}


@dataclass(frozen=True)
class Precision:
    """A stage's precision policy (the one option ``precision=``, like FSDP2's ``MixedPrecisionPolicy``).

    ``reduce_dtype``: None reduces gradients in the working dtype -- the paper's setting (its bytes are
    16-bit gradients), DeepSpeed's default (``communication_data_type``) and FSDP2's (``reduce_dtype=None``):
    half the bytes of fp32.  ``"fp32"`` widens each 16-bit gradient before the reduction and rounds the mean
    once, back into the 16-bit gradient: twice the bytes, but the sum of N values is neither rounded at every
    ring hop nor able to overflow fp16 on its way.  The loss-scale settings are torch's ``GradScaler``'s
    (initial 2^16, x2 after 2000 clean steps, x1/2 on overflow) with DeepSpeed's floor of 1."""

    name: str = "fp32"
    reduce_dtype: str | None = None
    loss_scale: float = 2.0 ** 16
    loss_scale_window: int = 2000
    min_loss_scale: float = 1.0

    def __post_init__(self):
        if self.name not in PRECISIONS:
            raise ValueError(f"precision must be one of {', '.join(PRECISIONS)}; got {self.name!r}")
        if self.reduce_dtype not in (None, *REDUCE_DTYPES):
            raise ValueError(f"reduce_dtype must be None (the working precision) or 'fp32'; got {self.reduce_dtype!r}")
        if self.reduce_dtype is not None and not self.mixed:
            raise ValueError("reduce_dtype only applies to mixed precision (precision='bf16' or 'fp16'): in fp32 "
                             "the gradients are reduced in fp32 already")
        if not (isinstance(self.min_loss_scale, (int, float)) and math.isfinite(self.min_loss_scale)
                and self.min_loss_scale > 0):
            raise ValueError(f"min_loss_scale must be a finite number > 0; got {self.min_loss_scale!r}")
        if not (isinstance(self.loss_scale, (int, float)) and math.isfinite(self.loss_scale)
                and self.loss_scale >= self.min_loss_scale):
            raise ValueError(f"loss_scale must be a finite number >= min_loss_scale ({self.min_loss_scale:g}); got "
                             f"{self.loss_scale!r}. The default, 2**16, is torch's GradScaler's.")
        if not (isinstance(self.loss_scale_window, int) and self.loss_scale_window >= 1):
            raise ValueError(f"loss_scale_window (clean steps before the scale doubles) must be a whole number >= 1; "
                             f"got {self.loss_scale_window!r}")

    @classmethod
    def of(cls, precision: "str | Precision | None") -> "Precision":
        """``"bf16"`` or a :class:`Precision`."""
        if isinstance(precision, Precision):
            return precision
        return cls("fp32" if precision is None else precision)

    @property
    def mixed(self) -> bool:
        return PRECISIONS[self.name] is not None

    @property
    def working_dtype(self) -> torch.dtype | None:
        return PRECISIONS[self.name]

    @property
    def scaled(self) -> bool:
        """Dynamic loss scaling: fp16 only (bf16 has fp32's range)."""
        return self.name == "fp16"

    def reduce_bytes(self, master_bytes: int) -> int:
        """Bytes per gradient element in the reduction."""
        if self.reduce_dtype is not None:
            return torch.empty(0, dtype=REDUCE_DTYPES[self.reduce_dtype]).element_size()
        return 2 if self.mixed else master_bytes

    def working_bytes(self, master_bytes: int) -> int:
        return 2 if self.mixed else master_bytes

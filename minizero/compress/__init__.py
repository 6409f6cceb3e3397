"""Gradient compression: the wire a stage averages its gradients over (``compress=``).

Three kinds of wire, each averaging through one method, ``average`` (:class:`minizero.comm.wire.WireProtocol`):

* the **16-bit wire** (``fp16``, ``bf16``; :mod:`.sixteen_bit`, :mod:`.summed`): the gradients are cast, summed *on the way*
  inside the ring all-reduce or reduce-scatter, and cast back -- half the bytes, on every stage;
* the **gathered wires** (:mod:`.gathered`) of codecs whose messages do not add up: ``int8`` / ``int4``
  (:mod:`.quantized`), ``fp8`` (:mod:`.float8`), ``topk:FRACTION`` (:mod:`.topk`), ``sign`` (:mod:`.sign`) -- each rank's message
  all-gathered (an all-reduce), or its shards' messages sent to their owners (a reduce-scatter: an all-to-all,
  ZeRO++'s qgZ), decoded and added in rank order;
* **PowerSGD** (``powersgd:rank=R``, :mod:`.powersgd`): each matrix as P Q^T, whose factors *do* add up --
  two small all-reduces; an all-reduce only.

A new codec is one file and one line in :data:`CODECS`: a name and the function that builds it from the text
after ``name:``.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..comm import Comm
from ..parts.precision import REDUCE_DTYPES, Precision
from .codec import Codec
from .float8 import Float8
from .gathered import GatheredWire
from .powersgd import PowerSGD, PowerSGDWire
from .quantized import Quantized
from .sign import Sign
from .sixteen_bit import WIRE_DTYPES, Wire, split_division
from .topk import TopK

#: name -> builder from the text after "name:" ("" when there is none).
CODECS = {
    "int8": lambda text: Quantized.from_spec(8, text),
    "int4": lambda text: Quantized.from_spec(4, text),
    "fp8": Float8.from_spec,
    "topk": TopK.from_spec,
    "sign": lambda text: Sign() if not text else _no_settings("sign", text),
    "powersgd": PowerSGD.from_spec,
}
NAMES = ("none", *WIRE_DTYPES, *CODECS)


def _no_settings(name: str, text: str):
    raise ValueError(f"compress={name}:{text}: {name} takes no settings")


def parse(compress: str | None) -> torch.dtype | Codec | PowerSGD | None:
    """``compress=`` read: None (no compression), a 16-bit dtype, a codec, or PowerSGD's settings."""
    if compress in (None, "none"):
        return None
    if compress in WIRE_DTYPES:
        return WIRE_DTYPES[compress]
    name, _, text = str(compress).partition(":")
    if name not in CODECS:
        raise ValueError(f"compress must be one of {', '.join(NAMES)} (e.g. int8, topk:0.01); got {compress!r}")
    return CODECS[name](text)


def split_specs(text: str) -> list[str]:
    """``"int8,powersgd:rank=4,start=10,topk:0.01"`` -> one spec per wire: a comma starts a new spec only where
    a wire's name follows it (a spec's own settings hold commas too).  Each is checked (:func:`parse`)."""
    specs: list[str] = []
    for piece in filter(None, (p.strip() for p in text.split(","))):
        if specs and piece.split(":")[0].removesuffix("+ef") not in NAMES:
            specs[-1] += "," + piece
        else:
            specs.append(piece)
    for spec in specs:
        parse(spec.removesuffix("+ef"))
    return specs


def check_compress(compress: str | None) -> torch.dtype | None:
    """The 16-bit wire's dtype, or None -- for a codec too (it has no dtype; see :func:`parse`)."""
    parsed = parse(compress)
    return parsed if isinstance(parsed, torch.dtype) else None


@dataclass(frozen=True)
class WirePolicy:
    """How a stage's gradients travel: one object, as FSDP2 groups its options into policies (its
    ``MixedPrecisionPolicy``; :class:`~minizero.parts.precision.Precision` is ours).  ``compress``: the wire's
    spec (``"fp16"``, ``"int8:block=64"``, ``"powersgd:rank=2"``; None: each gradient travels in its own dtype).
    ``error_feedback``: carry what compression did not send into the next step (Seide et al., 2014).  The command
    line's ``--compress`` and ``--error-feedback`` are its two fields (:mod:`minizero.stages.options`)."""

    compress: str | None = None
    error_feedback: bool = False

    @classmethod
    def of(cls, wire: "str | WirePolicy | None", rank: int = 0) -> "WirePolicy":
        """``"fp16"`` (a spec alone) or a :class:`WirePolicy`."""
        if isinstance(wire, WirePolicy):
            return wire
        if wire is None or isinstance(wire, str):
            return cls(wire)
        raise TypeError(f"rank {rank}: wire must be a WirePolicy or a compress spec such as 'fp16', got {wire!r}")


def check_wire(policy: WirePolicy, precision: Precision, averages_with: str = "all_reduce") -> None:
    """What no wire can be built for, decided from the options alone -- so the command line refuses it before any
    rank starts (``Stage.check_combination``), and :func:`make_wire` on every rank says the same."""
    compress, parsed = policy.compress, parse(policy.compress)
    if isinstance(parsed, (Codec, PowerSGD)):
        fits = ("all_reduce",) if isinstance(parsed, PowerSGD) else ("all_reduce", "reduce_scatter")
        if averages_with not in fits:
            how = ("adds each matrix's low-rank factors P and Q in all-reduces: a shard of a matrix has no factors "
                   "of its own, so it fits a stage that all-reduces its gradients (ddp, ddp-bucketed)"
                   if isinstance(parsed, PowerSGD) else "sends each rank's messages whole (an all-gather, or an "
                   "all-to-all of shards: ZeRO++'s qgZ), so it fits a stage that all-reduces or reduce-scatters its "
                   "gradients (ddp, ddp-bucketed, zero1-3)")
            instead = "a codec (int8, int4, topk, sign: an all-to-all, qgZ's idea) or compress='fp16' or 'bf16'" \
                if isinstance(parsed, PowerSGD) and averages_with == "reduce_scatter" else "compress='fp16' or 'bf16'"
            raise ValueError(f"compress={compress!r} {how}, not one that averages with a {averages_with}; use "
                             f"{instead}")
        if precision.mixed:
            raise ValueError(f"compress={compress!r} under {precision.name} mixed precision is not built: its "
                             f"loss scaling and 16-bit gradients are the 16-bit wire's; use precision='fp32'")
    elif parsed is None:
        if policy.error_feedback:
            raise ValueError("error feedback carries what compression did not send: it needs a compress= wire "
                             f"({', '.join(NAMES[1:])})")
    elif precision.reduce_dtype is not None:
        raise ValueError(f"compress={compress!r} and reduce_dtype={precision.reduce_dtype!r} both choose the dtype "
                         f"gradients are reduced in; give one (under mixed precision the gradients are already "
                         f"{precision.name}: reduce_dtype=None sends them as they are)")


def make_wire(comm: Comm, policy: WirePolicy, named_params=(), precision: Precision | None = None,
              averages_with: str = "all_reduce") -> "Wire | GatheredWire | PowerSGDWire | None":
    """The wire gradients are averaged over, or None: they travel in their own dtype.

    ``policy.compress`` ("fp16", "bf16") narrows fp32 gradients -- or, under mixed precision, re-rounds 16-bit ones
    with the split division and optional error feedback (:mod:`.sixteen_bit`).  Under mixed precision
    ``reduce_dtype="fp32"`` is a wire too, a *wider* one: 16-bit gradients summed in fp32, the mean rounded once.
    Both name the dtype of the reduction, so they are not given together.  With dynamic loss scaling an
    overflow is the scaler's to handle (the step is skipped), so the wire lets inf through instead of raising.
    A codec (``int8``, ``topk:0.01``, ...) rides on an all-reduce or a reduce-scatter (``averages_with``, the
    stage's), PowerSGD on an all-reduce only; both need full-precision gradients.  ``named_params``: what will
    travel on it, checked here."""
    precision = precision or Precision()
    check_wire(policy, precision, averages_with)
    parsed, error_feedback = parse(policy.compress), policy.error_feedback
    if isinstance(parsed, PowerSGD):
        return PowerSGDWire(comm, parsed, error_feedback)
    if isinstance(parsed, Codec):
        return GatheredWire(comm, parsed, error_feedback)
    if parsed is None:
        if precision.reduce_dtype is None:
            return None
        return Wire(comm, REDUCE_DTYPES[precision.reduce_dtype], overflow_raises=not precision.scaled)
    wire = Wire(comm, parsed, error_feedback, overflow_raises=not precision.scaled)
    if not precision.mixed:
        for name, p in named_params:
            wire.check_gradient_dtype(name, p.dtype)
    return wire


__all__ = ["CODECS", "Codec", "GatheredWire", "PowerSGD", "PowerSGDWire", "Wire", "WirePolicy", "check_compress", "make_wire",
           "check_wire", "parse", "split_division", "split_specs", "WIRE_DTYPES"]

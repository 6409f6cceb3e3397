"""A wrapper that declares its casts is judged against the reference that applies the same casts: a 16-bit wire
(``Wrapped(module, compress="fp16")``, as torch DDP with its ``fp16_compress_hook`` or ``bf16_compress_hook``), or
mixed precision (``Wrapped(module, precision=policy)``, the ``MixedPrecisionPolicy`` given to FSDP2's
``fully_shard``: the model computes in bf16, the optimizer steps fp32 parameters).

Exact single-device training is the wrong yardstick for either: a correct wrapper differs from it by its own
roundings.  minizero's same-casts reference (:mod:`minizero.course.harness.casts_reference`) rounds as minizero's
DDP does -- each rank's gradient computed in the working dtype, divided, cast, summed in the ring's order, divided
-- but someone else's wrapper sums in its own backend's order and may divide before the cast (torch's hook divides
by N in fp16; FSDP2 keeps the fp32 mean where minizero rounds it back into the bf16 gradient), so the two round
differently: equal bit for bit only where there is one order (:func:`~minizero.course.verify.run.one_order`).  So
the rule is relative to the casts themselves: after every step, each parameter may differ from the same-casts
reference by SLACK times what the casts may change in this step -- the larger of what they did change (the largest
distance of any parameter of the same-casts reference from exact training: model-wide, as float32's rule is) and
the dtype's unit roundoff times the step's largest update (what one rounding of the gradient moves: where the
reference's roundings happened to cancel, another order's need not) -- plus the dtype's usual tolerance.  Over
1,000 drawn examples torch's fp16 hook and a bf16 one reached 3.2 and 2.6 times that; over 300 a wrapper that
forgets a division reached 10,800 times, one that rounds to bf16 while declaring fp16 58.  A wrapper that rounds
nothing after all is correct training, within the bound -- though not bit for bit where there is one order.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

import torch

from ...parts.precision import Precision
from ...stages import DDP
from ...stages import STAGES as PACKAGE_STAGES
from ..harness.casts_reference import run_casts_reference
from ..harness.diagnosis import explain, initial_parameters
from ..harness.equivalence import RTOL, first_nonfinite, parameter_errors
from ..harness.experiment import exact_reference_of

#: How many times the casts' possible effect another wrapper's roundings may reach (measured: at most 3.2).
SLACK = 6.0
#: Each 16-bit dtype's unit roundoff: half the distance from 1 to the next number (fp16 keeps 11 bits, bf16 8).
UNIT_ROUNDOFF = {"fp16": 2.0 ** -11, "bf16": 2.0 ** -8}
#: What a wrapper may declare as its wire: the 16-bit dtypes of minizero's ``compress=`` and torch's two hooks.
WIRES = ("fp16", "bf16")
_NAMES = {torch.float16: "fp16", torch.bfloat16: "bf16"}


@dataclass(frozen=True)
class Casts:
    """What a wrapper rounds on purpose, as the reference stage's options that round the same way."""
    said: str  # "fp16 wire", "bf16 compute, gradients reduced in fp32"
    dtype: str  # the 16-bit dtype whose unit roundoff bounds one rounding
    options: dict = field(default_factory=dict)  # minizero's ``compress=`` or ``precision=``
    one_order: tuple = (1, 2)  # world sizes where the casts round in one order: judged bit for bit


def declared_casts(compress=None, precision=None) -> Casts | None:
    """The casts a :class:`~minizero.course.verify.Wrapped` declares, or None; anything else refused in words."""
    if compress is not None and compress not in WIRES:
        raise ValueError(f"Wrapped(compress={compress!r}): declare the dtype the wrapper's gradients cross the wire in, "
                         f"one of {', '.join(map(repr, WIRES))} (torch's fp16_compress_hook, bf16_compress_hook), or "
                         f"None for a full-width wire")
    policy = _policy(precision)
    if compress is not None and policy is not None:
        raise ValueError(f"Wrapped(compress={compress!r}, precision=...): verify judges one declared rounding at a "
                         f"time -- a 16-bit wire or mixed precision; verify each alone")
    if compress is not None:
        return Casts(f"{compress} wire", compress, {"compress": compress})
    if policy is None:
        return None
    if isinstance(policy, str):  # the model computes in its own dtype, its gradients reduced in 16 bits: a wire
        return declared_casts(policy)
    reduced = "in fp32" if policy.reduce_dtype else "in bf16"
    # FSDP2 keeps the fp32 mean; minizero rounds it back into the bf16 gradient: equal bit for bit at N = 1 only
    return Casts(f"bf16 compute, gradients reduced {reduced}", "bf16", {"precision": policy},
                 (1,) if policy.reduce_dtype else (1, 2))


def _policy(precision) -> "Precision | str | None":
    """``precision=`` as minizero's :class:`Precision` (bf16 compute), a 16-bit wire's name, or None: from
    ``"bf16"``, a :class:`Precision`, or torch's ``MixedPrecisionPolicy`` read field by field."""
    if precision is None or isinstance(precision, Precision):
        policy = precision
    elif isinstance(precision, str):
        policy = Precision(precision) if precision in ("bf16", "fp16") else None
        if policy is None:
            raise ValueError(f"Wrapped(precision={precision!r}): declare 'bf16', or the MixedPrecisionPolicy given "
                             f"to fully_shard")
    elif all(hasattr(precision, k) for k in ("param_dtype", "reduce_dtype", "output_dtype")):
        policy = _from_torch(precision)
        if not isinstance(policy, Precision):
            return policy  # nothing, or a 16-bit wire
    else:
        raise TypeError(f"Wrapped(precision={precision!r}): declare 'bf16', or the MixedPrecisionPolicy given to "
                        f"fully_shard")
    if policy is not None and policy.scaled:
        raise ValueError("Wrapped(precision=fp16): fp16 compute needs a loss scaler (torch's ShardedGradScaler), which "
                         "verify does not drive; declare bf16 compute")
    return policy if policy is None or policy.mixed else None


def _from_torch(policy) -> "Precision | str | None":
    """torch's ``MixedPrecisionPolicy``, field by field.  fp32 is a cast too: ``verify`` draws float64 models, which
    an fp32 compute or reduction rounds -- a rounding it has no reference for, so such a policy is refused."""
    compute, reduce = policy.param_dtype, policy.reduce_dtype
    said = f"MixedPrecisionPolicy(param_dtype={compute}, reduce_dtype={reduce}, output_dtype={policy.output_dtype})"
    if policy.output_dtype is not None:
        raise ValueError(f"{said}: verify judges the outputs in the compute dtype (output_dtype=None, FSDP2's default)")
    if compute == torch.float32 or compute is None and reduce == torch.float32:
        raise ValueError(f"{said}: fp32 rounds the float64 models verify draws, a cast it has no reference for; "
                         f"on an fp32 model the policy rounds nothing -- declare none, or bf16 compute")
    if compute is None:  # the model's own dtype computes: only the reduction rounds -- a 16-bit wire, or nothing
        if reduce not in (None, torch.float16, torch.bfloat16):
            raise ValueError(f"{said}: verify judges a reduction in fp16 or bf16 (a 16-bit wire) or bf16 compute")
        return None if reduce is None else _NAMES[reduce]
    if compute not in (torch.float16, torch.bfloat16) or reduce not in (None, compute, torch.float32):
        raise ValueError(f"{said}: verify judges bf16 compute with the gradients reduced in bf16 or fp32")
    return Precision(_NAMES[compute], reduce_dtype="fp32" if reduce == torch.float32 else None)


def references(exp, world_size: int, casts: Casts):
    """(the same-casts reference, exact single-device training) for ``exp`` -- the casts laid out as minizero's
    ``ddp`` lays out its buffers: per element, one division, one cast, one sum, as any DDP."""
    plain = replace(exp, stage=DDP.name, options={}, stages=PACKAGE_STAGES)
    return (run_casts_reference(replace(plain, options=casts.options), world_size, DDP),
            exact_reference_of(plain, world_size))


def what_is_wrong_against_the_casts(results: list, exp, world_size: int, casts: Casts,
                                    bit_for_bit: bool = False) -> str | None:
    """None when every rank, after every step, is within SLACK times the casts' own effect of the same-casts
    reference (plus the dtype's tolerance) -- or, ``bit_for_bit`` (where the casts round in one order), equal to it;
    else where it is not, in words, with the direction where it can be told."""
    reference, exact = references(exp, world_size, casts)
    nonfinite = first_nonfinite(results, reference)
    if nonfinite:
        return nonfinite
    rtol, before = RTOL[exp.dtype], initial_parameters(exp)
    for step, want in enumerate(reference.params):
        did = max((err for _, err, _ in parameter_errors(want, exact.params[step], exp.dtype)), default=0.0)
        update = max((err for _, err, _ in parameter_errors(want, before, exp.dtype)), default=0.0)
        effect, before = max(did, UNIT_ROUNDOFF[casts.dtype] * update), want
        for rank, result in enumerate(results):
            for name, err, scale in parameter_errors(result.params[step], want, exp.dtype):
                if not err <= (0.0 if bit_for_bit else SLACK * effect + rtol * scale):
                    ratio = f"{err / effect:.3g}x" if effect else "more than"
                    where = (f"after step {step + 1}, rank {rank}'s {name} differs from the same-casts "
                             f"({casts.said}) reference by {err:.3g}: {ratio} what the casts may change in this step "
                             f"({effect:.3g}), "
                             + (f"where at N = {world_size} the casts round in one order and the two are equal bit "
                                f"for bit (a cast not declared, or left out?)" if bit_for_bit else
                                f"over the {SLACK:g}x it is allowed and the {exp.dtype} tolerance"))
                    told = explain(results, reference, initial_parameters(exp), exp.dtype, world_size, exp.accum)
                    return where + (f"\n    {told}" if told and math.isfinite(err) else "")
    return None

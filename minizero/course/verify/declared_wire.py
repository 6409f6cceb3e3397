"""A wrapper that declares a 16-bit wire -- ``Wrapped(module, compress="fp16")``, as torch DDP with its
``fp16_compress_hook`` or ``bf16_compress_hook`` -- is judged against the reference that applies the same casts.

Exact single-device training is the wrong yardstick for it: every gradient is rounded to 16 bits on the way, so
a correct wrapper differs from exact training by the wire's own rounding.  minizero's same-casts reference
(:mod:`minizero.course.harness.casts_reference`) rounds as minizero's DDP does -- divide, cast, sum in the ring's
order, divide -- but someone else's wrapper sums in its own backend's order and may divide before the cast
(torch's hook divides by N in fp16), so the two round differently: equal bit for bit only where there is one
order (N <= 2, division by powers of two).  So the rule is relative to the wire itself: after every step, each
parameter may differ from the same-casts reference by SLACK times what the wire may change in this step -- the
larger of what it did change (the largest distance of any parameter of the same-casts reference from exact
training: model-wide, as float32's rule is) and the wire's unit roundoff times the step's largest update (what
one rounding of the gradient moves: where the reference's roundings happened to cancel, another order's need
not) -- plus the dtype's usual tolerance.  Over 1,000 drawn examples torch's fp16 hook and a bf16 one reached 3.2
and 2.6 times that; over 300 a wrapper that forgets a division reached 10,800 times, one that rounds to bf16 while
declaring fp16 58.  Where the wire has one order of rounding (:func:`~minizero.course.verify.run.one_order`) the
verdict is bit for bit.  A wrapper that sends 32 bits after all is correct training, within the bound (its bytes
are another question) -- though not bit for bit where the wire has one order.
"""
from __future__ import annotations

import math
from dataclasses import replace

from ...stages import DDP
from ...stages import STAGES as PACKAGE_STAGES
from ..harness.casts_reference import run_casts_reference
from ..harness.diagnosis import explain, initial_parameters
from ..harness.equivalence import RTOL, first_nonfinite, parameter_errors
from ..harness.experiment import exact_reference_of

#: How many times the wire's possible effect another wrapper's roundings may reach (measured: at most 3.2).
SLACK = 6.0
#: Each wire's unit roundoff: half the distance from 1 to the next number (fp16 keeps 11 bits, bf16 8).
UNIT_ROUNDOFF = {"fp16": 2.0 ** -11, "bf16": 2.0 ** -8}

#: What a wrapper may declare: the 16-bit dtypes of minizero's ``compress=`` and torch's two hooks.
WIRES = ("fp16", "bf16")


def check_declared_wire(compress) -> str | None:
    if compress is not None and compress not in WIRES:
        raise ValueError(f"Wrapped(compress={compress!r}): declare the dtype the wrapper's gradients cross the wire in, "
                         f"one of {', '.join(map(repr, WIRES))} (torch's fp16_compress_hook, bf16_compress_hook), or "
                         f"None for a full-width wire")
    return compress


def references(exp, world_size: int, wire: str):
    """(the same-casts reference, exact single-device training) for ``exp`` on a ``wire`` -- the casts laid out
    as minizero's ``ddp`` lays out its buffers: per element, one division, one cast, one sum, as any DDP."""
    plain = replace(exp, stage=DDP.name, options={}, stages=PACKAGE_STAGES)
    return (run_casts_reference(replace(plain, options={"compress": wire}), world_size, DDP),
            exact_reference_of(plain, world_size))


def what_is_wrong_on_the_wire(results: list, exp, world_size: int, wire: str, bit_for_bit: bool = False) -> str | None:
    """None when every rank, after every step, is within SLACK times the wire's own effect of the same-casts reference
    (plus the dtype's tolerance) -- or, ``bit_for_bit`` (where the wire has one order of rounding), equal to it;
    else where it is not, in words, with the direction where it can be told."""
    casts, exact = references(exp, world_size, wire)
    nonfinite = first_nonfinite(results, casts)
    if nonfinite:
        return nonfinite
    rtol, before = RTOL[exp.dtype], initial_parameters(exp)
    for step, want in enumerate(casts.params):
        did = max((err for _, err, _ in parameter_errors(want, exact.params[step], exp.dtype)), default=0.0)
        update = max((err for _, err, _ in parameter_errors(want, before, exp.dtype)), default=0.0)
        effect, before = max(did, UNIT_ROUNDOFF[wire] * update), want
        for rank, result in enumerate(results):
            for name, err, scale in parameter_errors(result.params[step], want, exp.dtype):
                if not err <= (0.0 if bit_for_bit else SLACK * effect + rtol * scale):
                    ratio = f"{err / effect:.3g}x" if effect else "more than"
                    where = (f"after step {step + 1}, rank {rank}'s {name} differs from the same-casts ({wire}) "
                             f"reference by {err:.3g}: {ratio} what the {wire} wire may change in this step "
                             f"({effect:.3g}), " + (f"where at N = {world_size} the wire has one order of rounding and "
                                                    f"the two are equal bit for bit (a cast not declared, or left out?)"
                                                    if bit_for_bit else
                                                    f"over the {SLACK:g}x it is allowed and the {exp.dtype} tolerance"))
                    told = explain(results, casts, initial_parameters(exp), exp.dtype, world_size, exp.accum)
                    return where + (f"\n    {told}" if told and math.isfinite(err) else "")
    return None

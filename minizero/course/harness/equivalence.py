"""What "equivalent to single-device training" means -- one definition, used by ``compare``, ``soak``,
the property suite and the lessons.

After every step, every parameter on every rank must match the reference's,
and so must the global loss and (when recorded) every optimizer state:

* **float64**: relative to each tensor's largest element, ``RTOL = 1e-9``;
* **float32**: relative to the *model's* largest parameter (normwise),
  ``RTOL = 1e-5``.  A zero-initialised bias one step old is lr times a
  gradient that may be a cancellation, whose float32 rounding is large
  relative to *it* in any summation order -- per-tensor would flag noise;
* optimizer states: normwise per kind of state (Adam's ``exp_avg_sq`` is a
  square: its relative error is twice the gradient's, so 4x the tolerance);
* a NaN or inf anywhere -- a loss, a parameter, a state, on any rank or in
  the reference itself -- is a failure, never a small difference.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

DTYPES = {"float64": torch.float64, "float32": torch.float32}
RTOL = {"float64": 1e-9, "float32": 1e-5}


@dataclass(frozen=True)
class Verdict:
    max_abs_diff: float  # largest |parameter - reference| over ranks, steps, tensors
    max_rel_diff: float  # the same, relative to the scale the dtype's rule uses
    loss_rel_diff: float
    nonfinite: str | None  # where the first NaN or inf is
    violation: str | None  # the first comparison over the tolerance, in words

    @property
    def ok(self) -> bool:
        return self.nonfinite is None and self.violation is None


def judge(results: list, reference, dtype: str, rtol: float | None = None, states: bool = False) -> Verdict:
    """Compare every rank's :class:`~minizero.course.harness.experiment.RankResult` with the reference's."""
    rtol = RTOL[dtype] if rtol is None else rtol
    worst_abs = worst_rel = worst_loss = 0.0
    violation = None
    for step, ref_params in enumerate(reference.params):
        for rank, result in enumerate(results):
            if violation is None:
                violation = shape_violation(result.params[step], ref_params, f"after step {step + 1}, rank {rank}'s")
            for name, err, scale in parameter_errors(result.params[step], ref_params, dtype):
                worst_abs, worst_rel = max(worst_abs, err), max(worst_rel, err / scale)
                if violation is None and not err <= rtol * scale:
                    violation = (f"after step {step + 1}, rank {rank}'s {name} differs from the reference by {err:.3g} "
                                     f"(tolerance {rtol:g} x {scale:.3g})")
        total = sum(r.losses[step] for r in results)
        ref_loss = reference.losses[step]
        loss_rel = abs(total - ref_loss) / max(abs(ref_loss), 1e-300)
        loss_rel = loss_rel if math.isfinite(loss_rel) else math.inf
        worst_loss = max(worst_loss, loss_rel)
        if violation is None and not loss_rel <= rtol:
            violation = f"step {step + 1}: the global loss {total} differs from the reference's {ref_loss}"
        if violation is None and states and reference.optimizer_states:
            violation = optimizer_state_violation(results[0].optimizer_states[step],
                                                  reference.optimizer_states[step], rtol, f"step {step}")
    return Verdict(worst_abs, worst_rel, worst_loss, first_nonfinite(results, reference), violation)


def shape_violation(params: dict, ref_params: dict, where: str) -> str | None:
    """A parameter missing or read back in another shape than the reference's: no difference can be taken, and
    a sharded wrapper's placeholder (ZeRO-3's, FSDP's: 0 elements outside a forward) is the usual cause."""
    for name, ref in ref_params.items():
        got = params.get(name)
        if got is None or got.shape != ref.shape:
            what = "is missing" if got is None else f"has shape {tuple(got.shape)}"
            return (f"{where} {name} {what}, the reference's {tuple(ref.shape)}: the full parameters were not read "
                    f"back (a sharded wrapper's placeholder? read the whole values: a full state dict, a gather)")
    return None


def parameter_errors(params: dict, ref_params: dict, dtype: str):
    """``(name, |Δ|, scale)`` per parameter, the scale by the dtype's rule; an error that is not finite is inf."""
    model_scale = max((p.abs().max().item() for p in ref_params.values() if p.numel()), default=0.0)
    for name, ref in ref_params.items():
        if params.get(name) is None or params[name].shape != ref.shape:
            yield name, math.inf, 1.0  # no difference to take: infinitely far (judge says why: shape_violation)
            continue
        if ref.numel() == 0:
            continue
        err = (params[name] - ref).abs().max().item()
        scale = max(ref.abs().max().item() if dtype == "float64" else model_scale, 1e-300)
        if not (math.isfinite(err) and math.isfinite(scale)):
            err, scale = math.inf, 1.0  # infinitely far, absolutely and relatively
        yield name, err, scale


def optimizer_state_violation(got: dict, want: dict, rtol: float, where: str) -> str | None:
    """Every state tensor (Adam's exp_avg, exp_avg_sq, momentum buffers...) of every parameter, normwise
    per kind of state over the whole model; for ZeRO stages ``got`` is consolidated from all ranks' shards."""
    if set(got["state"]) != set(want["state"]):
        extra, missing = sorted(set(got["state"]) - set(want["state"])), sorted(set(want["state"]) - set(got["state"]))
        return (f"{where}: the optimizer holds "
                + "; and ".join(filter(None, [
                    extra and f"state for parameter(s) #{', #'.join(map(str, extra))}, which one device never stepped (a "
                              f"parameter without a gradient anywhere was stepped: zeros taken for a gradient?)",
                    missing and f"no state for parameter(s) #{', #'.join(map(str, missing))}, which one device "
                                f"stepped (a gradient that existed somewhere never reached them)"]))
                + " -- numbered in the optimizer's order, as torch's state_dict() numbers them")
    keys = {k for state in want["state"].values() for k, v in state.items() if torch.is_tensor(v) and v.numel()}
    for key in sorted(keys):
        pairs = [(index, got["state"][index][key], state[key]) for index, state in want["state"].items()
                 if key in state and state[key].numel()]
        scale = max(ref.abs().max().item() for _, _, ref in pairs)
        for index, value, ref in pairs:
            err = (value.to(ref.dtype) - ref).abs().max().item()
            if not (err <= 4 * rtol * scale or err < 1e-30):
                return f"{where}: optimizer state {key} of parameter #{index}: |Δ|={err:.3g}, scale {scale:.3g}"
    return None


def first_nonfinite(results: list, reference) -> str | None:
    """Where the first NaN or inf is -- in a loss, a parameter or an optimizer state, of any rank or of
    the reference (single-device training that diverged proves nothing either) -- or None."""
    for who, result in [("the reference", reference)] + [(f"rank {r}", res) for r, res in enumerate(results)]:
        for step, loss in enumerate(result.losses):
            if not math.isfinite(loss):
                return f"{who}: the loss of step {step} is {loss}"
        for step, params in enumerate(result.params):
            for name, value in params.items():
                if not bool(torch.isfinite(value).all()):
                    return f"{who}: parameter {name!r} after step {step} is not finite"
        for index, entry in (result.optimizer_state or {}).get("state", {}).items():
            for key, value in entry.items():
                if torch.is_tensor(value) and not bool(torch.isfinite(value).all()):
                    return f"{who}: optimizer state {key!r} of parameter #{index} is not finite"
    return None


def bit_identical(results: list, reference) -> bool:
    """Every parameter of every rank after every step equal to the reference's, bit for bit."""
    return all(torch.equal(r.params[s][n], p) for r in results
               for s, params in enumerate(reference.params) for n, p in params.items())


def agrees(measured: float, formula: float, rel: float = 0.02) -> bool:
    """A measured byte count within ``rel`` of its formula (padding to a multiple of N adds a little)."""
    return math.isfinite(measured) and abs(measured - formula) <= rel * max(formula, 1.0)


def dtype_name(reference) -> str:
    first = next((p for params in reference.params for p in params.values()), None)
    return "float64" if first is not None and first.dtype == torch.float64 else "float32"


def max_diff(results: list, reference) -> tuple[float, float]:
    """(largest absolute, largest relative) parameter difference, by :func:`judge`'s rule for the dtype;
    infinite if anything is not finite."""
    verdict = judge(results, reference, dtype_name(reference))
    if verdict.nonfinite:
        return math.inf, math.inf
    return verdict.max_abs_diff, verdict.max_rel_diff


def loss_error(results: list, reference) -> float:
    """Largest relative error of the global loss over the steps."""
    return judge(results, reference, dtype_name(reference)).loss_rel_diff

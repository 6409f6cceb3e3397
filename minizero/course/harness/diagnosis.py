"""A wrong number, said so that a learner -- or a maintainer reading a red suite -- can act on it: which
parameter, on which rank, after which step, and how its update compares with single-device training's.

"differs by 1.19e-09 (tolerance 1e-09 x 1.19)" reads as equal.  What a learner
needs is the *shape* of the error, which points at the line that made it:

* the ranks disagree with each other -- the replicas drifted apart: the ranks
  did not apply the same update (a gradient not averaged, a shard not shared);
* every rank agrees and is wrong -- the update itself is wrong, by a ratio:
  N times (a sum, not a mean), 1/N (divided twice), K or 1/K (the micro-batches),
  the opposite sign, zero (it never moved), or another direction altogether;
* only some of a parameter's elements are wrong -- a shard's offset or a range
  left out, said as the elements' range.

The update is measured from where the step started (after the previous step,
which matched: the first failing step is the one explained), so a parameter's
scale does not hide it.
"""
from __future__ import annotations

import math

import torch

from .equivalence import DTYPES, RTOL, judge, parameter_errors, shape_violation
from .tasks import TASKS


def explain(results: list, reference, initial: dict, dtype: str, world_size: int, accum: int = 1) -> str | None:
    """The first wrong parameter after the first wrong step, in words -- or None when every parameter matches
    (a loss or an optimizer state differs: :func:`~minizero.course.harness.equivalence.judge` says that)."""
    rtol = RTOL[dtype]
    for step, want in enumerate(reference.params):
        for rank, result in enumerate(results):
            shape = shape_violation(result.params[step], want, f"after step {step + 1}, rank {rank}'s")
            if shape:  # no difference to describe
                return shape
            for name, err, scale in parameter_errors(result.params[step], want, dtype):
                if not err <= rtol * scale:
                    before = initial if step == 0 else reference.params[step - 1]
                    return _explain_one(results, want, before, name, step, rank, rtol * scale, world_size, accum)
    return None


def _explain_one(results, want: dict, before: dict, name: str, step: int, rank: int, tol: float, n: int,
                 accum: int) -> str:
    got = [r.params[step][name].double() for r in results]
    ref, start = want[name].double(), before[name].double()
    at = f"after step {step + 1}, rank {rank}'s {name}"
    spread = max((g - got[0]).abs().max().item() for g in got)
    if spread > tol:  # the replicas are no longer replicas
        right = [r for r, g in enumerate(got) if (g - ref).abs().max().item() <= tol]
        off = [r for r, g in enumerate(got) if r not in right]
        who = (f"rank{'s' if len(right) > 1 else ''} {_ranks(right)} match{'es' if len(right) == 1 else ''} the "
               f"reference, rank{'s' if len(off) > 1 else ''} {_ranks(off)} do{'es' if len(off) == 1 else ''} not"
               if right else "no rank matches the reference")
        return (f"{at} differs from rank {0 if rank else 1}'s by "
                f"{spread:.3g}: the ranks disagree ({who}) -- the replicas drifted apart, so the ranks did not apply "
                f"the same update (a gradient not averaged, or an update not shared with every rank?)")
    mine = got[rank]
    wrong = ((mine - ref).abs() > tol).reshape(-1)
    part = ""
    idx = wrong.nonzero().reshape(-1)
    if 1 < len(idx) < wrong.numel() and int(idx[-1] - idx[0]) + 1 == len(idx):  # one block, the rest right:
        # a range's doing (a shard's offset, a piece left out) -- not rounding, which scatters over the tensor (or
        # lands on one element: a single wrong value is no range)
        part = (f"; {len(idx)} of its {wrong.numel()} elements are wrong (flat indices {int(idx[0])}-"
                f"{int(idx[-1])}, one block), the others match -- a range left out, or a shard's offset?")
    same = " (the same on every rank)" if len(got) > 1 else ""
    how = update_words(mine - start, ref - start, tol, n, accum)
    return f"{at}{same} is off by {(mine - ref).abs().max().item():.3g}: {how}{part}"


def update_words(mine: torch.Tensor, want: torch.Tensor, tol: float, n: int, accum: int,
                 theirs: str = "the reference") -> str:
    """How this step's update compares with ``theirs``' (single-device training's, or a lab's own yardstick -- the
    package's local SGD): a ratio and a direction."""
    size, wanted = mine.norm().item(), want.norm().item()
    if wanted <= tol:
        return (f"{theirs} left it where it was, yours moved it by {mine.abs().max().item():.3g} "
                f"(a frozen, unused or zero-gradient parameter stepped?)")
    if size <= tol:
        return (f"it never moved ({theirs} moved it by {want.abs().max().item():.3g}): its update was lost -- "
                f"no averaged gradient reached it, or it was overwritten after the step")
    ratio = torch.dot(mine.reshape(-1), want.reshape(-1)).item() / wanted ** 2
    residual = (mine - ratio * want).norm().item() / wanted
    if residual > 0.05:
        cosine, longer = torch.dot(mine.reshape(-1), want.reshape(-1)).item() / (size * wanted), size / wanted
        if not 1e-3 < longer < 1e3:  # "cosine 0.00, 1.19e+293x as long" said nothing a learner could use
            return (f"its update is {longer:.3g} times as long as {theirs}'s: "
                    f"{'too large' if longer > 1 else 'too small'} by orders of magnitude, not a wrong factor -- an "
                    f"overflow, memory never written (torch.empty), or a value from another tensor?")
        if cosine > 0.95:  # the right direction, mostly: a share added twice or left out
            return (f"its update points nearly {theirs}'s way (cosine {cosine:.3f}) but is {longer:.3g}x as long, "
                    f"{'too large' if longer > 1 else 'too small'} and not by a whole factor: part of the gradient "
                    f"{'counted twice' if longer > 1 else 'lost'} -- one micro-batch's, one rank's or one branch's?")
        return (f"its update points another way than {theirs}'s (cosine {cosine:.2f}, {longer:.3g}x as "
                f"long): not a scaling of the right gradient -- other data, another parameter's gradient, or a mix")
    return f"its update is {ratio:.4g}x {theirs}'s ({_ratio_words(ratio, n, accum)})"


def _ratio_words(ratio: float, n: int, accum: int) -> str:
    """The direction, and the factor it most likely is."""
    if ratio < 0:
        return "the opposite direction" + (f", {-ratio:.3g}x as long" if not _near(ratio, -1) else "")
    named = [(n, f"too large by N = {n}: the sum over ranks, not the mean?"),
             (1 / n, f"too small by N = {n}: divided by N twice?"),
             (accum, f"too large by K = {accum}: the micro-batches summed, not averaged?"),
             (1 / accum, f"too small by K = {accum}: only one micro-batch's share?"),
             (n * accum, f"too large by N x K = {n * accum}"), (1 / (n * accum), f"too small by N x K = {n * accum}")]
    for factor, words in named:
        if factor != 1 and _near(ratio, factor):
            return words
    if _near(ratio, 1, 1e-3):
        return ("the right direction and almost the right length: a slightly different sum -- another order of "
                "addition, another precision, or a cast in between?")
    return "too large" if ratio > 1 else "too small"


def _near(x: float, target: float, rel: float = 0.02) -> bool:
    return math.isfinite(x) and abs(x - target) <= rel * abs(target)


def _ranks(ranks: list[int]) -> str:
    return ", ".join(map(str, ranks))


def initial_parameters(exp) -> dict:
    """Every parameter as single-device training starts (rank 0's seed: every rank starts from it after the
    wrap-time broadcast)."""
    model = TASKS[exp.task].make_model(exp.seed, DTYPES[exp.dtype], **exp.model)
    return {name: p.detach().clone() for name, p in model.named_parameters()}


def what_is_wrong(results: list, reference, exp, world_size: int) -> str | None:
    """None when ``results`` equal ``reference`` by the suite's rule (:func:`~minizero.course.harness.equivalence.judge`);
    else what is wrong, in words: a NaN or inf where it is, else :func:`explain`'s parameter, rank, step, ratio and
    direction, else judge's own words (a loss or an optimizer state)."""
    verdict = judge(results, reference, exp.dtype, states=exp.record_states)
    if verdict.ok:
        return None
    if verdict.nonfinite:
        return verdict.nonfinite
    return explain(results, reference, initial_parameters(exp), exp.dtype, world_size, exp.accum) or verdict.violation

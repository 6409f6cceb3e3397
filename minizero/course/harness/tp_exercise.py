"""Lesson 15's exercise: a tensor-parallel MLP, judged against the unsplit one -- values, gradients and all-reduces.

The learner writes the MLP of a transformer block as ``t`` simulated ranks run it (Megatron-LM, arXiv:1909.08053):
``fc`` split column-parallel (each rank a block of its rows), GeLU on each rank's own columns, ``out`` split
row-parallel (the matching block of its columns), the ranks' partial outputs summed by Megatron's ``g``
(:class:`~minizero.course.harness.parallelism.ReduceFromRanks`, the all-reduce) and ``out``'s bias added once;
the input handed to the ranks by ``f`` (:class:`~minizero.course.harness.parallelism.CopyToRanks`), whose backward
all-reduces the input's gradient.  Judged as a lab is: at t = 1, 2 and 4, every rank's output and every gradient
against the unsplit MLP's (float64, 1e-12), and the all-reduces counted -- a wrong one told which rank, which way,
and the likely slip, never "every property holds".
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .parallelism import Ledger

D, HIDDEN, DEGREES = 8, 32, (1, 2, 4)
TOLERANCE = 1e-12


def _weights(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    shapes = {"fc": (HIDDEN, D), "fc_bias": (HIDDEN,), "out": (D, HIDDEN), "out_bias": (D,), "x": (2, 3, D),
              "probe": (2, 3, D)}
    return {k: torch.randn(*shape, dtype=torch.float64, generator=g) for k, shape in shapes.items()}


def _shards(w: dict, t: int) -> list[dict[str, torch.Tensor]]:
    """Rank r's leaves: its rows of ``fc`` (and of its bias), its columns of ``out``, its own copy of ``out``'s bias."""
    h = HIDDEN // t
    return [{"fc": w["fc"][r * h:(r + 1) * h], "fc_bias": w["fc_bias"][r * h:(r + 1) * h],
             "out": w["out"][:, r * h:(r + 1) * h], "out_bias": w["out_bias"]} for r in range(t)]


def _leaves(shards: list[dict]) -> list[dict]:
    return [{k: v.clone().requires_grad_() for k, v in s.items()} for s in shards]


def _close(a, b) -> bool:
    return isinstance(a, torch.Tensor) and a.shape == b.shape and bool(torch.allclose(a, b, rtol=0, atol=TOLERANCE))


def _values(outs, w: dict, shards: list[dict], t: int) -> str | None:
    want = F.gelu(w["x"] @ w["fc"].T + w["fc_bias"]) @ w["out"].T + w["out_bias"]
    if not isinstance(outs, (list, tuple)) or len(outs) != t:
        return f"t = {t}: return one output per rank, a list of {t} tensors -- got {type(outs).__name__}"
    for r, out in enumerate(outs):
        if not isinstance(out, torch.Tensor) or out.shape != want.shape:
            return (f"t = {t}: rank {r}'s output has shape {tuple(getattr(out, 'shape', ()))}; the MLP's is "
                    f"{tuple(want.shape)} -- the row-parallel partial outputs are summed, not concatenated")
        if _close(out, want):
            continue
        partial = F.gelu(w["x"] @ shards[r]["fc"].T + shards[r]["fc_bias"]) @ shards[r]["out"].T
        if t > 1 and _close(out, want + (t - 1) * w["out_bias"]):
            return (f"t = {t}: rank {r}'s output holds out's bias {t} times: each rank added it before the sum -- add "
                    f"it once, after the all-reduce")
        if t > 1 and (_close(out, partial + w["out_bias"]) or _close(out, partial)):
            return (f"t = {t}: rank {r}'s output is its own partial sum: the row-parallel layer's outputs are summed "
                    f"over the ranks (ReduceFromRanks, Megatron's g: the all-reduce)")
        return f"t = {t}: rank {r}'s output is off the unsplit MLP's by {(out - want).abs().max().item():.1e}"
    return None


def _gradients(outs, w: dict, xs: list, ranks: list[dict], t: int) -> str | None:
    x = w["x"].clone().requires_grad_()
    whole = {k: w[k].clone().requires_grad_() for k in ("fc", "fc_bias", "out", "out_bias")}
    ((F.gelu(x @ whole["fc"].T + whole["fc_bias"]) @ whole["out"].T + whole["out_bias"]) * w["probe"]).sum().backward()
    sum((o * w["probe"]).sum() for o in outs).backward()  # every rank's loss on its own copy of the output
    for r, xr in enumerate(xs):
        if xr.grad is not None and t > 1 and _close(xr.grad, t * x.grad):
            return (f"t = {t}: rank {r}'s input gradient is {t} times the whole one: the ranks' outputs share one "
                    f"summed tensor, so backward counts every rank's loss on each -- sum with ReduceFromRanks (g), "
                    f"whose backward gives each rank only its own copy's gradient")
        if xr.grad is None or not _close(xr.grad, x.grad):
            return (f"t = {t}: rank {r}'s input gradient is not the whole one -- hand the input to the ranks with "
                    f"CopyToRanks (Megatron's f), whose backward all-reduces what each rank's part of fc sends back")
    want = _shards({**w, **{k: v.grad for k, v in whole.items()}}, t)
    for r, (mine, theirs) in enumerate(zip(ranks, want, strict=True)):
        for name, leaf in mine.items():
            if leaf.grad is None:
                return f"t = {t}: no gradient reached rank {r}'s {name} -- was it detached, or left unused?"
            if not _close(leaf.grad, theirs[name]):
                return (f"t = {t}: rank {r}'s {name} gradient is off the unsplit MLP's matching slice by "
                        f"{(leaf.grad - theirs[name]).abs().max().item():.1e}")
    return None


def judge_tensor_parallel_mlp(fn) -> tuple[bool, str]:
    """``(passed, verdict)`` for ``fn(xs, ranks, ledger)`` -- ``xs``: the input, one copy per rank; ``ranks[r]``: rank
    r's ``fc``, ``fc_bias``, ``out`` and ``out_bias``; ``ledger``: where ``f`` and ``g`` count their all-reduces --
    returning every rank's output."""
    counted = []
    for t in DEGREES:  # values and gradients at every degree first: a slip told by what it computes
        w = _weights(seed=t)
        ranks, ledger = _leaves(_shards(w, t)), Ledger()
        xs = [w["x"].clone().requires_grad_() for _ in range(t)]
        try:
            outs = fn(xs, ranks, ledger)
        except NotImplementedError:
            return False, "write my_tensor_parallel_mlp: it still raises NotImplementedError"
        except Exception as error:  # noqa: BLE001 -- the learner's error, in words
            return False, f"t = {t}: your function raised {type(error).__name__}: {error}"
        problem = _values(outs, w, _shards(w, t), t)
        forward = ledger.count("forward")
        if not problem:
            try:
                problem = _gradients(outs, w, xs, ranks, t)
            except RuntimeError as error:
                problem = f"t = {t}: backward through your outputs raised: {error}"
        if problem:
            return False, problem
        if t > 1:  # one rank communicates with no one: f and g may be left out there
            counted.append((t, forward, ledger.count("backward")))
    for t, forward, backward in counted:  # then how it communicated
        if forward != 1:
            return False, (f"t = {t}: the values are right, but {forward} all-reduce(s) were counted forward; "
                           f"Megatron's MLP makes one -- sum the ranks' partial outputs with ReduceFromRanks (g)")
        if backward != 1:
            return False, (f"t = {t}: {backward} all-reduce(s) counted in backward; Megatron's MLP makes one, f's, on "
                           f"the input's gradient")
    return True, (f"t = {', '.join(map(str, DEGREES))}: every rank's output and every gradient equal the unsplit MLP's "
                  f"(float64, {TOLERANCE:g}); one all-reduce forward (g) and one backward (f)")

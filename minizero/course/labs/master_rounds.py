"""The mixed-precision lab's probe: the learner's ``MasterWeights`` driven on every rank as a stage drives it,
beside the package's on the same gradients.

A training run shows a wrong step late and blurred (Adam, the all-gather, the
next forward); here two steps of the class alone say which rank did what.  Each
rank holds a few 16-bit working tensors and their fp32 masters -- its shard --
with 16-bit gradients already multiplied by the loss scale, as backward leaves
them; one element of one rank's gradient may be inf or NaN.  The package's
:class:`~minizero.parts.masters.MasterWeights` is run beside it with no
communication, told the true verdict (an overflow on *any* rank), so what the
learner's class should give is known on every rank without trusting its
collective.  Everything is compared exactly: an unscale by a power of two in
fp32, the optimizer's step and the rounding into 16 bits have one right answer.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from ...comm import make_comm
from ...parts.masters import MasterWeights
from ...parts.precision import Precision
from .loading import Impl
from .raised import Raised

_ARTICLE = {"inf": "an inf", "-inf": "a -inf", "nan": "a NaN"}
ROUNDS = 2  # the second step shows what the first left behind: the halved scale, stale gradients


@dataclass(frozen=True)
class MasterCase:
    """Two steps of ``MasterWeights`` on ``world_size`` ranks, drawn in the checker's process."""

    world_size: int
    precision: str  # "fp16" or "bf16"
    loss_scale: float
    sizes: tuple  # numel of each working tensor (a rank's pieces; 0: a piece this rank owns none of)
    missing: tuple  # per step, the tensors with no gradient (unused everywhere: .grad None on every rank)
    poison: tuple | None  # (rank, tensor, element, value) in the first step's gradient
    optimizer: str  # "sgd", "momentum" or "adam"
    clip_first: bool  # clipping unscales before the step (GradScaler.unscale_, then step)
    outside: bool  # the optimizer built after wrapping: hand_over, the user's step, refresh before the forward
    seed: int
    window: int | None = None  # clean steps before the scale doubles (torch's growth_interval); None: Precision's

    def describe(self) -> str:
        where = "no inf or NaN" if self.poison is None else (
            f"{_ARTICLE[self.poison[3]]} in element {self.poison[2]} of tensor {self.poison[1]}'s gradient on rank "
            f"{self.poison[0]} only, in step 1")
        order = "the optimizer built after wrapping (hand_over, its step, refresh)" if self.outside else \
            "the optimizer at wrap time (step)"
        return (f"world size {self.world_size}, {self.precision}, loss scale {self.loss_scale:g}, working tensors of "
                f"{list(self.sizes)} element(s), {where}, {self.optimizer}, {order}"
                + (", clipping first (unscale_ before the step)" if self.clip_first else "")
                + (f", the scale doubling after every {self.window} clean step(s)" if self.window else "")
                + f", seed {self.seed}")


def _gradient(case: MasterCase, rank: int, step: int, t: int, dtype) -> torch.Tensor | None:
    """Rank ``rank``'s 16-bit gradient of tensor ``t`` in ``step``: the true gradient (1e-8 to 1e-1, so that
    in fp16 some fall below the normal range once divided by the scale) times the scale, as backward leaves it."""
    if t in case.missing[step]:
        return None
    g = torch.Generator().manual_seed(case.seed * 7919 + rank * 613 + step * 97 + t)
    n = case.sizes[t]
    magnitude = torch.pow(10.0, torch.rand(n, generator=g) * 7 - 8)
    sign = torch.where(torch.rand(n, generator=g) < 0.5, -1.0, 1.0)
    grad = (sign * magnitude * case.loss_scale).to(dtype)
    if step == 0 and case.poison is not None and case.poison[:2] == (rank, t):
        grad[case.poison[2]] = float(case.poison[3])
    return grad


def _overflow_anywhere(case: MasterCase, step: int, dtype) -> bool:
    """The true verdict: an inf or NaN in any rank's gradient this step (every rank can tell: the data is drawn)."""
    if case.precision != "fp16":
        return False  # bf16 has fp32's range: no loss scale, no overflow check (as in torch and DeepSpeed)
    return any(g is not None and not bool(torch.isfinite(g).all())
               for r in range(case.world_size) for t in range(len(case.sizes))
               for g in [_gradient(case, r, step, t, dtype)])


def _pair(case: MasterCase, rank: int, cls: type, comm, dtype):
    """Working tensors, their masters, an optimizer over the masters, and ``cls`` over them."""
    g = torch.Generator().manual_seed(case.seed * 31 + rank)
    masters = [nn.Parameter(torch.randn(n, generator=g)) for n in case.sizes]
    working = [nn.Parameter(m.detach().to(dtype)) for m in masters]
    lr = 1e-3 if case.optimizer == "adam" else 0.5
    optimizer = (torch.optim.Adam(masters, lr=lr) if case.optimizer == "adam" else
                 torch.optim.SGD(masters, lr=lr, momentum=0.9 if case.optimizer == "momentum" else 0.0))
    window = {"loss_scale_window": case.window} if case.window else {}
    precision = Precision(case.precision, loss_scale=case.loss_scale, **window)
    return working, masters, optimizer, cls(working, masters, precision, comm, optimizer_outside=case.outside)


def master_rounds(me, impl: Impl, case: MasterCase) -> list[dict] | Raised:
    """On this rank: the learner's class and the package's, two steps each; per step what the learner's did
    (stepped? raised? how many all-reduces?) and the first thing in which it differs from the package's."""
    comm = make_comm("ring", check=True)
    try:
        cls = impl.cls().master_class
        dtype = torch.float16 if case.precision == "fp16" else torch.bfloat16
        working, masters, optimizer, mine = _pair(case, me.rank, cls, comm, dtype)
        w_ref, m_ref, o_ref, ref = _pair(case, me.rank, MasterWeights, None, dtype)
        calls = []
        all_reduce = comm.all_reduce

        def counted(*args, **kwargs):
            calls.append(1)
            return all_reduce(*args, **kwargs)

        comm.all_reduce = counted
        told, told_ref = [], []  # what a listener of each hears after each step: (taken, rescale)
        mine.settled.append(lambda *heard: told.append(heard))
        ref.settled.append(lambda *heard: told_ref.append(heard))
        steps = []
        for step in range(ROUNDS):
            overflow = _overflow_anywhere(case, step, dtype)
            ref._agree_on_overflow = lambda overflow=overflow: overflow  # what agreeing must find
            for w, wr, t in zip(working, w_ref, range(len(working)), strict=True):
                w.grad = _gradient(case, me.rank, step, t, dtype)
                wr.grad = None if w.grad is None else w.grad.clone()
            calls.clear()
            before = ([m.detach().clone() for m in masters], [w.detach().clone() for w in working], ref.loss_scale)
            record = {"overflow": overflow, "stepped": None, "raised": None, "problem": None}
            refused = False  # the learner's step raised FloatingPointError: divergence declared
            try:
                want = _drive(ref, o_ref, case)
            except FloatingPointError:
                want = "raised"
            try:
                record["stepped"] = _drive(mine, optimizer, case)
            except Exception as error:  # noqa: BLE001 -- what the learner's step raised, in words
                record["raised"] = str(Raised.now(me.rank, error, impl.path))
                refused = isinstance(error, FloatingPointError)
            record["all_reduces"] = len(calls)
            if want == "raised" or record["raised"]:
                if want != "raised":
                    record["problem"] = record["raised"] + (
                        f"\n    (the package skipped this step: at loss scale {before[2]:g} an overflow halves the "
                        f"scale, to {ref.loss_scale:g}; only one at the minimum is divergence -- decide on the scale "
                        f"the step began with, before telling the scaler)"
                        if refused and want is False else "")
                elif not record["raised"]:
                    record["problem"] = (f"step {step + 1}, rank {me.rank}'s step() returned, its masters never moved: "
                                         f"at the minimum loss scale ({case.loss_scale:g}) an overflow is divergence, "
                                         f"not a too-large scale -- step() must raise (the given "
                                         f"_refuse_overflow_at_the_floor()), not skip the step forever")
                steps.append(record)
                break
            record["problem"] = _differs(me.rank, step, case, (working, masters, optimizer, mine),
                                         (w_ref, m_ref, o_ref, ref), want, record["stepped"], before) \
                or _unheard(me.rank, step, told, told_ref)
            steps.append(record)
        return steps
    except Exception as error:  # noqa: BLE001
        return Raised.now(me.rank, error, impl.path)
    finally:
        comm.close()


def _drive(weights, optimizer, case: MasterCase):
    """One step as a stage drives it: clipping may unscale first; then the stage's step -- or, with the
    optimizer outside, the gradients handed over, the user's step and the refresh before the next forward."""
    if case.outside:
        weights.hand_over()
        if case.clip_first:
            _clip(weights)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        weights.refresh()
        return None
    if case.clip_first:
        _clip(weights)
    return weights.step(optimizer.step)


def _clip(weights) -> None:
    """What clipping does to the unscaled fp32 gradients: scales them in place (here by 1/2, exact) -- a step that
    unscaled them again would undo it."""
    for m in weights.unscaled_masters():
        if m.grad is not None:
            m.grad.mul_(0.5)


def _unheard(rank: int, step: int, told: list, due: list) -> str | None:
    """The listeners in ``settled`` told what the package tells them, once a step: whether it was taken, and by
    what factor the loss scale changed -- else a 16-bit wire with error feedback keeps a skipped step's residuals,
    or leaves them in the old scale's units."""
    if told == due:
        return None
    return (f"step {step + 1}, rank {rank}'s listeners in self.settled were told {told or 'nothing'}; the package "
            f"tells them {due} ((taken, new scale / old scale), once a step): a 16-bit wire with error feedback "
            f"keeps or rescales its residuals by it -- left out, it ends too large or too small under fp16")


def _differs(rank: int, step: int, case: MasterCase, mine, ref, want_stepped, stepped, start) -> str | None:
    """The first thing the learner's class left different from the package's, in words: the step, the rank, the
    tensor, and which way it is off.  ``start``: the masters and working copies before the step, and its scale."""
    before, before_working, scale = start
    working, masters, optimizer, weights = mine
    w_ref, m_ref, o_ref, ref = ref
    at = f"step {step + 1}, rank {rank}'s"
    if not case.outside and not want_stepped and stepped:
        moved = [(float((m.detach() - b).abs().max()), t) for t, (m, b) in enumerate(zip(masters, before, strict=True))
                 if m.numel()]
        most, t = max(moved, default=(0.0, 0))
        return (f"{at} master {t}: the step was taken and moved it by {most:.3g}, though some rank's gradient held an "
                f"inf or NaN -- a step in which any rank's gradient overflowed is skipped on every rank, touching "
                f"nothing")
    if not case.outside and want_stepped and stepped is not True:
        return (f"{at} step() returned {stepped!r} after a step that should be taken (no rank's gradient "
                f"overflowed): ZeRO-1/2 all-gather the updated shards only after a step that returns True, so the "
                f"other ranks' copies of this shard never moved")
    for t, (m, mr, b) in enumerate(zip(masters, m_ref, before, strict=True)):
        if not torch.equal(m.detach(), mr.detach()):
            return f"{at} master {t}: {_first(m, mr)}" + _why(case, step, m, mr, b, scale)
    for t, (w, wr, m, b) in enumerate(zip(working, w_ref, masters, before_working, strict=True)):
        if not torch.equal(w.detach(), wr.detach()):
            rounded = torch.equal(w.detach(), m.detach().to(w.dtype))
            return (f"{at} working copy {t}: {_first(w, wr)} -- " +
                    ("its master rounded, but not the package's: the masters it was rounded from differ" if rounded
                     else ("it never moved in this step" if torch.equal(w.detach(), b) else "not its master rounded")
                     + ": round every stepped master into its working copy after the optimizer's step (refresh)"))
    if weights.loss_scale != ref.loss_scale or weights.skipped_steps != ref.skipped_steps:
        way = "too large" if weights.loss_scale > ref.loss_scale else "too small"
        return (f"{at} loss scale: {weights.loss_scale:g} after {weights.skipped_steps} skipped step(s), should be "
                f"{ref.loss_scale:g} after {ref.skipped_steps} ({way}) -- tell the scaler every step whether it "
                f"overflowed (it halves the scale then, and counts the skip)")
    if not case.outside:
        kept = [t for t, m in enumerate(masters) if m.grad is not None]
        if kept:
            return (f"{at} master(s) {kept}: their fp32 gradients are still held after step() -- the state kept "
                    f"between steps is too large by 4 bytes a parameter, and a later step without a gradient for "
                    f"them would reuse it: set each master's .grad to None when the step ends, taken or skipped")
    mine_state, ref_state = optimizer.state_dict()["state"], o_ref.state_dict()["state"]
    for i in ref_state:
        for k, v in ref_state[i].items():
            if i not in mine_state or not torch.equal(torch.as_tensor(mine_state[i][k]), torch.as_tensor(v)):
                return f"{at} optimizer state ({k} of master {i}): its elements are wrong, against the package's"
    if case.outside:
        versions = [w._version for w in working]
        if weights.refresh() or [w._version for w in working] != versions:
            return (f"{at} working copy: refresh() right after a refresh, with no master changed since, wrote it "
                    f"again (or returned True) -- ZeRO-1/2 take a write to the working copy for a step to all-gather: "
                    f"round only the masters whose value changed since they were last rounded")
    return None


def _first(got: torch.Tensor, want: torch.Tensor) -> str:
    bad = (got.detach() != want.detach()).nonzero()
    i = int(bad[0]) if len(bad) else 0
    return f"element {i} is {got.detach()[i].item():.9g}, should be {want.detach()[i].item():.9g}"


def _why(case: MasterCase, step: int, m, mr, before, scale: float) -> str:
    """Which way the master is off, and a hint from the shape of the difference: stepped where every rank should
    have skipped, or an update that is the package's times one factor (the loss scale: not unscaled; 1/S: unscaled
    twice; 2: clipping undone)."""
    mine, want = (m.detach() - before).double(), (mr.detach() - before).double()
    if step == 0 and _overflow_anywhere(case, 0, torch.float16 if case.precision == "fp16" else torch.bfloat16):
        return (f" -- the step moved it by {mine.abs().max().item():.3g}, though some rank's gradient held an inf or "
                f"NaN: every rank must skip that step, touching no master (agree on the overflow across ranks: one "
                f"flag, all-reduced with MAX)")
    if not math.isfinite(m.detach().abs().max().item()):
        return " -- the step moved it by inf: an inf or NaN reached the masters"
    moved = want.abs() > 1e-3 * before.double().abs()  # updates well above the master's rounding: ratios exact to 1e-4
    if moved.any():
        ratios = mine[moved] / want[moved]
        ratio = ratios.median().item()
        if torch.allclose(ratios, torch.full_like(ratios, ratio), rtol=1e-2):
            hint = {scale: "the gradients were not divided by the loss scale",
                    1 / scale: "the gradients were divided by the loss scale twice",
                    2.0: "clipping scaled the unscaled gradients before the step, and a second unscale in the same "
                         "step undid it: unscale once a step"}
            near = next((words for r, words in hint.items() if abs(ratio - r) <= 1e-2 * abs(r)), None)
            if abs(ratio) < 1e-2:
                return " -- it never moved: the step did not reach it"
            if near and (ratio != 2.0 or case.clip_first):
                return f" -- its update is {ratio:.4g}x the package's ({'too large' if ratio > 1 else 'too small'}): {near}"
    length = mine.norm().item() / max(want.norm().item(), 1e-300)
    cosine = float(mine @ want) / max(mine.norm().item() * want.norm().item(), 1e-300)
    way = ("points another way" if cosine < 0.999 else "is almost the right length" if abs(length - 1) < 1e-2 else
           "is too large" if length > 1 else "is too small")
    return (f" -- its update {way} (cosine {cosine:.4f}, {length:.4g}x as long, scale {scale:g}): unscale each "
            f"gradient once per step -- widened to the masters' dtype first, then divided by the scale there, where a "
            f"power of two divides exactly (in 16 bits, small gradients lose their bits)")

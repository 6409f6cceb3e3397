"""PowerSGD (Vogels, Karimireddy and Jaggi, NeurIPS 2019): each gradient matrix sent as a rank-r product.

A gradient matrix M (n x m; a convolution's or any tensor's trailing dimensions flattened, as torch does) is
approximated by P Q^T with P n x r and Q m x r: (n + m) r numbers instead of n m.  Unlike int8 codes or top-k lists,
**P and Q add up** -- the mean of the ranks' M_w Q is (mean M) Q -- so PowerSGD rides on two ordinary all-reduces,
and its bytes do not grow with N.  One step on rank w, for one buffer (the paper's Algorithms 1 and 2, and torch's
``powerSGD_hook``):

1. ``carried = g_w + e_w`` (error feedback: what earlier steps did not deliver);
2. the buffer is cut into its tensors; a tensor is compressed only if ``(n + m) r * min_rate < n m`` (vectors,
   biases and small matrices are not: they are averaged as they are, in one all-reduce);
3. ``P_w = M_w Q`` per matrix; **all-reduce P** (summed: the scale is lost in the next line anyway);
4. ``P <- orthogonalize(P)`` (Gram-Schmidt for r <= 2 or 16-bit values, QR otherwise, as torch chooses);
5. ``Q_w = M_w^T P``; **all-reduce Q**, divided by N: now ``P Q^T`` = (mean M) projected on P's columns;
6. ``M <- P Q^T``; with error feedback ``e_w <- carried - result`` -- the *mean's* approximation, not the
   rank's own (the paper's choice and torch's): averaged over ranks the residuals are exactly what the mean
   missed, so ``sum(applied) + mean(e) = sum(mean g)`` over any number of steps.

Q starts random (the same numbers on every rank: a seed drawn from one generator per wire, in the order the buffers
are reduced) and, with ``warm_start``, each step starts from the last step's Q: one power iteration per step,
continued across steps, which is why rank 1 or 2 is enough (the paper's Section 3).  The first ``start`` steps are
averaged uncompressed (torch: ``start_powerSGD_iter``, 1000 there; 0 here, so a short run is compressed at once).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from ..comm import Comm, ReduceOp
from ..costs.formulas import all_reduce_bytes
from .codec import parse_arguments
from .kept import KeepsResiduals
from .powersgd_layout import Layout, back_project, lay_out, matrix, orthogonalize, p_of, project, q_of, rest_of


@dataclass(frozen=True)
class PowerSGD:
    """The settings, e.g. ``powersgd:rank=2,start=0,min_rate=2,warm_start=1,epsilon=0,seed=0`` -- torch's
    ``PowerSGDState`` fields (matrix_approximation_rank, start_powerSGD_iter, min_compression_rate,
    warm_start, orthogonalization_epsilon, random_seed); error feedback is the stage's ``error_feedback``."""
    rank: int = 1
    start: int = 0
    min_rate: float = 2.0
    warm_start: bool = True
    epsilon: float = 0.0
    seed: int = 0
    name = "powersgd"

    @classmethod
    def from_spec(cls, text: str) -> "PowerSGD":
        settings = cls(**parse_arguments("powersgd", text, {"rank": int, "start": int, "min_rate": float,
                                                             "warm_start": bool, "epsilon": float, "seed": int},
                                         first="rank"))
        if settings.rank < 1 or settings.start < 0 or settings.min_rate <= 0 or settings.epsilon < 0:
            raise ValueError(f"compress=powersgd:{text}: rank must be >= 1, start >= 0, min_rate > 0, epsilon >= 0")
        return settings

    def spec(self) -> str:
        return (f"powersgd:rank={self.rank},start={self.start},min_rate={self.min_rate:g},"
                f"warm_start={int(self.warm_start)},epsilon={self.epsilon:g},seed={self.seed}")


def power_step(carried: list[torch.Tensor], layout: Layout, q: torch.Tensor, sum_over_ranks, n: int,
               epsilon: float, where: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Steps 2-6 for one buffer: the approximated mean, and the new Q.  ``carried`` holds the buffers this
    process has -- one rank's on a rank, every rank's in the reference (:mod:`minizero.course.harness.casts_reference`) --
    and ``sum_over_ranks`` adds a list of per-rank tensors across ranks (the all-reduce, or its emulation), so
    the stage and its reference run these very lines."""
    out = torch.empty_like(carried[0])
    rest = sum_over_ranks([rest_of(c, layout) for c in carried]) / n
    at = 0
    for a, k in layout.rest:
        out[a:a + k] = rest[at:at + k]
        at += k
    if not layout.matrices:
        return out, q
    p = sum_over_ranks([project(c, layout, q) for c in carried])
    for mx in layout.matrices:
        orthogonalize(p_of(p, mx), epsilon, f"{where}: P of {mx.name}")
    q = sum_over_ranks([back_project(c, layout, p) for c in carried]) / n
    for mx in layout.matrices:
        torch.bmm(p_of(p, mx)[None], q_of(q, mx).t()[None], out=matrix(out, mx)[None])  # torch's bmm, as its hook
    return out, q


class PowerState:
    """What every rank keeps alike: the warm-start Q of each buffer, how often each buffer was averaged, and
    the generator of Q's seeds (torch's ``np.random.RandomState(random_seed)``: one seed per fresh Q, drawn
    in the order the buffers are reduced -- a buffer with no matrix draws one too, as in torch)."""

    def __init__(self, settings: PowerSGD):
        self.settings = settings
        self.q: dict = {}  # key -> the last step's Q (warm start)
        self.steps: dict = {}  # key -> how many times that buffer has been averaged
        self.draws = 0
        self._seeds = np.random.RandomState(settings.seed)

    def compresses(self, key) -> bool:
        """Counts this step of buffer ``key``; False for the first ``start`` steps (averaged as they are)."""
        step = self.steps.get(key, 0)
        self.steps[key] = step + 1
        return step >= self.settings.start

    def starting_q(self, key, layout: Layout, dtype: torch.dtype, device, where: str) -> torch.Tensor:
        """The Q this step starts from: last step's, orthogonalized again (warm start), or a fresh random one."""
        q = self.q.get(key) if self.settings.warm_start else None
        if q is None or q.numel() != layout.q_size:
            self.draws += 1
            generator = torch.Generator().manual_seed(int(self._seeds.randint(1_000_000_000)))
            q = torch.empty(layout.q_size, dtype=dtype)
            for mx in layout.matrices:
                q_of(q, mx).copy_(torch.randn(mx.m, mx.r, generator=generator, dtype=dtype))
            q = q.to(device)
        for mx in layout.matrices:
            orthogonalize(q_of(q, mx), self.settings.epsilon, f"{where}: Q of {mx.name}")
        return q

    def keep(self, key, q: torch.Tensor) -> None:
        if self.settings.warm_start:
            self.q[key] = q

    def state_dict(self) -> dict:
        return {"q": dict(self.q), "steps": dict(self.steps), "draws": self.draws}

    def load_state_dict(self, state: dict, device) -> None:
        self.q.update({k: v.to(device) for k, v in state["q"].items()})
        self.steps.update(state["steps"])
        self._seeds, self.draws = np.random.RandomState(self.settings.seed), 0
        for _ in range(state["draws"]):  # the generator where it stood: replay its draws
            self.draws += 1
            self._seeds.randint(1_000_000_000)


class PowerSGDWire(KeepsResiduals):
    """PowerSGD as a stage's wire (``compress="powersgd:rank=2"``): it runs its own all-reduces."""

    def __init__(self, comm: Comm, settings: PowerSGD, error_feedback: bool = False):
        self.comm, self.settings, self.error_feedback = comm, settings, error_feedback
        self.state = PowerState(settings)
        self.residuals: dict = {}  # key -> e_w of that buffer: this rank's own
        self.formula_by_kind = {"all_reduce": 0.0}  # what the ledger should count: 2(N-1)/N of each all-reduce's bytes

    @property
    def wire_dtype(self) -> str:
        """What travels, as a checkpoint records it (a resumed run must use the same settings)."""
        return self.settings.spec()

    @property
    def keeps_state(self) -> bool:
        """Always: the warm-start Qs, the step counts (``start``) and the seed draws decide the next steps with
        error feedback or without it (saved with error feedback only, a resumed run once drifted 8.6e-3 off, and
        with ``start=15`` never compressed again)."""
        return True

    def held(self) -> list[torch.Tensor]:
        """What the wire keeps between steps: the residuals and the warm-start Qs."""
        return [*self.residuals.values(), *self.state.q.values()]

    def state_dict(self) -> dict:
        return {"residuals": dict(self.residuals), **self.state.state_dict()}

    def load_state_dict(self, state: dict, device) -> None:
        self.residuals.update({k: v.to(device) for k, v in state["residuals"].items()})
        self.state.load_state_dict(state, device)

    def _sum(self, tensors: list[torch.Tensor], tag) -> torch.Tensor:
        (tensor,) = tensors
        if tensor.numel():  # (an empty one is not sent: every rank has the same layout)
            self.comm.all_reduce(tensor, ReduceOp.SUM, tag=tag)
        return tensor

    def power_step(self, carried: torch.Tensor, plan: Layout, q: torch.Tensor, tag) -> tuple[torch.Tensor, torch.Tensor]:
        """Steps 2-6 on this rank's ``carried`` buffer from the starting ``q``: the approximated mean and the new Q
        (lesson 16's lab writes this one).  Each all-reduce sums one tensor over the ranks, in place."""
        return power_step([carried], plan, q, lambda ts: self._sum(ts, tag), self.comm.world_size,
                          self.settings.epsilon, f"rank {self.comm.rank}")

    def average(self, comm, collective, kind: str, arguments: dict, key, tag, layout) -> None:
        where = f"rank {self.comm.rank}"
        if kind != "all_reduce":
            raise ValueError(f"{where}: compress=powersgd adds P and Q with all-reduces; a {kind} would need each "
                             f"shard's own low-rank factors")
        comm.check_copied(kind, arguments, tag)  # its own collectives see only its copies
        if layout is None:
            raise ValueError(f"{where}: compress=powersgd needs the tensors the buffer holds (layout=[(name, shape), "
                             f"...]) to cut it into matrices")
        flat = arguments["tensor"].reshape(-1)
        n, element = self.comm.world_size, flat.element_size()
        if not self.state.compresses(key):  # the first `start` steps: averaged as they are -- divided first, as
            flat /= n                        # torch's hook does (default_hooks._allreduce_fut: against fp16 overflow)
            self._sum([flat], tag)
            self.formula_by_kind["all_reduce"] += all_reduce_bytes(flat.numel() * element, n)
            return
        carried = flat.clone()
        self.carry(key, carried, self.comm.rank)
        plan = lay_out(layout, self.settings)
        self.formula_by_kind["all_reduce"] += plan.sent_bytes(n, element)
        q = self.state.starting_q(key, plan, flat.dtype, flat.device, where)
        out, q = self.power_step(carried, plan, q, tag)
        if not bool(torch.isfinite(out).all()):  # never written into the weights, the residual kept as it was
            raise FloatingPointError(f"{where}: inf/NaN in PowerSGD's mean of "
                                     f"{(tag.describe() if tag else 'a gradient buffer')}; the weights were not touched")
        self.state.keep(key, q)
        if self.error_feedback:
            self.residuals[key] = carried - out
        flat.copy_(out)

"""Stage ``local-sgd``: every rank trains alone, and the ranks average their parameters every H steps.

DDP averages *gradients* every step, so the replicas never differ.  Local SGD
(Stich, "Local SGD Converges Fast and Communicates Little", ICLR 2019; the
"parameter averaging" of the older literature) lets each rank step its own
replica on its own data for ``H`` steps, then averages the *parameters*:
``H`` times fewer bytes, at the price of replicas that drift apart in between.

When is it single-device training?  With ``H = 1`` and plain SGD (and no
clipping: each rank clips its own gradient):
``mean_r(p - lr g_r) = p - lr mean_r(g_r)`` -- DDP's step (tested, to 1e-9).
Anything else breaks it: with ``H > 1`` each rank's later gradients are
taken at its own parameters, and with momentum or Adam each rank's state
sees only its own gradients (those states are never averaged here, as in
DiLoCo).  ``compare`` measures how far a run goes; lesson 13 plots it
against ``H``.

**DiLoCo** (Douillard et al., arXiv:2311.08105) adds an *outer optimizer*:
the averaged change ``anchor - mean_r(p_r)`` is treated as a gradient of the
parameters at the last average (the anchor), and stepped by Nesterov SGD --
the paper's outer learning rate 0.7, momentum 0.9.  ``outer_lr=1`` with
``outer_momentum=0`` is plain averaging again.

Bytes: one all-reduce of the parameters every ``H`` steps,
``2(N-1)/N Psi b / H`` per step.  Memory: DDP's, plus the anchor and the
outer momentum with DiLoCo.  Checkpoints are refused: between averages the
ranks hold different models, and their optimizer states always differ.
"""
from __future__ import annotations

import math
from numbers import Real

import torch
from torch import nn

from ..comm import Comm, ReduceOp
from ..costs.formulas import all_reduce_bytes
from ..parts.flat import group_by_dtype, pack, unpack
from .base import Stage
from .options import Option, finite_float, positive_float, positive_int
from .wrap import broadcast_module, check_same_model


class LocalSGD(Stage):
    name = "local-sgd"
    contrast = True
    equivalent = False  # local steps: by design not single-device training, except H = 1 with plain SGD
    options = (Option("average_every", 4, "average the parameters every H steps", positive_int),
               Option("outer_lr", None, "DiLoCo's outer Nesterov SGD with this lr (0.7 in the paper)", positive_float),
               Option("outer_momentum", None, "the outer momentum (0.9)", finite_float))
    why_not_checkpointable = "between averages its ranks hold different models, and their optimizer states always differ"

    def __init__(self, module: nn.Module, optimizer: torch.optim.Optimizer | None = None, comm: Comm | None = None,
                 average_every: int = 4, outer_lr: float | None = None, outer_momentum: float | None = None):
        rank = comm.rank if comm is not None else 0  # checked before wrapping: a refusal changes nothing
        if optimizer is None:
            raise ValueError(f"rank {rank}: stage {self.name!r} averages the parameters after every "
                             f"{average_every} optimizer steps, so it must own the optimizer: pass yours to "
                             f"make_stage(name, model, optimizer, comm)")
        if isinstance(average_every, bool) or not isinstance(average_every, int) or average_every < 1:
            raise ValueError(f"rank {rank}: stage {self.name!r} takes average_every as a whole number of "
                             f"steps >= 1 (1 averages every step), got {average_every!r}")
        self.check_outer(rank, outer_lr, outer_momentum)
        outer_momentum = self.OUTER_MOMENTUM if outer_momentum is None else outer_momentum
        super().__init__(module, optimizer, comm)
        self.average_every = average_every
        check_same_model(module, comm)
        broadcast_module(module, comm)
        self.outer = None  # DiLoCo: Nesterov SGD over the anchor -- the parameters at the last average
        if outer_lr is not None:
            self.anchor = [nn.Parameter(p.detach().clone()) for _, p in self.trainable()]
            self.outer = torch.optim.SGD(self.anchor, lr=outer_lr, momentum=outer_momentum,
                                         nesterov=outer_momentum > 0)

    OUTER_MOMENTUM = 0.9  # DiLoCo's, when outer_lr is given without it

    @classmethod
    def check_command_line(cls, world_size: int, steps: int, given: dict) -> None:
        every, outer_lr, momentum = given.get("average_every"), given.get("outer_lr"), given.get("outer_momentum")
        if momentum is not None and outer_lr is None:
            raise ValueError(f"--outer-momentum {momentum:g} has no effect without --outer-lr: plain averaging has no "
                             f"outer optimizer; add --outer-lr (DiLoCo's 0.7) or drop --outer-momentum")
        if momentum is not None and not 0 <= momentum < 1:
            raise ValueError(f"--outer-momentum {momentum:g}: the outer Nesterov momentum must be at least 0 and below "
                             f"1 (at 1 or more the outer steps grow without bound); use 0.9, DiLoCo's")
        if every is not None and every > steps:
            raise ValueError(f"--average-every {every} with --steps {steps}: the ranks would never average -- {steps} "
                             f"step(s) of unrelated replicas, not local SGD, and the bytes formula (one all-reduce per "
                             f"{every} steps) would count traffic that never happened; use --average-every {steps} or "
                             f"less, or --steps {every} or more")

    @classmethod
    def check_outer(cls, rank: int, outer_lr, outer_momentum) -> None:
        """DiLoCo's outer optimizer, refused before anything is wrapped: an inf rate makes every average inf, and
        a momentum without the outer optimizer would be ignored (plain averaging has no momentum)."""
        def number(x) -> bool:
            return isinstance(x, Real) and not isinstance(x, bool) and math.isfinite(x)
        if outer_lr is None:
            if outer_momentum is not None:
                raise ValueError(f"rank {rank}: stage {cls.name!r}: outer_momentum={outer_momentum!r} has no effect "
                                 f"without outer_lr (plain averaging has no outer optimizer); pass outer_lr (DiLoCo's "
                                 f"0.7) too, or leave outer_momentum out")
            return
        momentum = cls.OUTER_MOMENTUM if outer_momentum is None else outer_momentum
        if not (number(outer_lr) and outer_lr > 0 and number(momentum) and 0 <= momentum < 1):
            raise ValueError(f"rank {rank}: stage {cls.name!r}: the outer optimizer needs a finite outer_lr > 0 and "
                             f"0 <= outer_momentum < 1, got {outer_lr!r} and {outer_momentum!r}")

    def post_backward(self) -> None:
        """Nothing to synchronise after backward: each rank steps on its own gradient."""

    def load_full_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """A resumed run's anchor is the loaded parameters, its outer momentum fresh."""
        super().load_full_state_dict(state)
        if self.outer is not None:
            with torch.no_grad():
                for anchor, (_, p) in zip(self.anchor, self.trainable(), strict=True):
                    anchor.copy_(p)
            self.outer.state.clear()

    def step(self) -> None:
        with self.stepping():
            self.optimizer_step()  # this rank's own step, on its own gradient
            if (self.steps_taken + 1) % self.average_every == 0:
                self.average()

    @torch.no_grad()
    def average(self) -> None:
        """Every replica becomes the mean of all of them -- or, with DiLoCo, the anchor stepped by that mean."""
        params = [p for _, p in self.trainable()]
        tag = self.tag("parameters, averaged")
        for dtype, group in group_by_dtype(params).items():
            flat = pack([p.detach() for p in group])
            self.comm.all_reduce(flat, ReduceOp.AVG, tag=tag)
            unpack(flat, group)
        if self.outer is not None:
            for anchor, p in zip(self.anchor, params, strict=True):
                anchor.grad = anchor.detach() - p  # the outer gradient: how far the average moved, reversed
            self.outer.step()
            for anchor, p in zip(self.anchor, params, strict=True):
                p.copy_(anchor)

    def held_tensors(self) -> dict[str, list[torch.Tensor]]:
        held = super().held_tensors()
        held["outer"] = [] if self.outer is None else self.anchor + [
            t for state in self.outer.state.values() for t in state.values() if torch.is_tensor(t)]
        return held

    # ------------------------------------------------------------------ facts
    @classmethod
    def sent_bytes_per_step(cls, psi, world_size, grad_bytes, param_bytes, average_every: int = 4,
                            **options) -> float:
        """One all-reduce of the parameters every H steps (exact over a multiple of H steps)."""
        return all_reduce_bytes(psi * param_bytes, world_size) / average_every

    @classmethod
    def state_bytes(cls, psi, world_size, element_size, state_tensors, precision=None, outer_lr=None,
                    outer_momentum=None, **options) -> float:
        """DDP's, plus the anchor and (with momentum) the outer momentum with DiLoCo."""
        return super().state_bytes(psi, world_size, element_size, state_tensors) + psi * cls._outer_bytes(
            element_size, outer_lr, outer_momentum)

    @classmethod
    def state_formula(cls, element_size, state_tensors, precision=None, outer_lr=None, outer_momentum=None,
                      **options) -> str:
        base, outer = super().state_formula(element_size, state_tensors), cls._outer_bytes(element_size, outer_lr,
                                                                                            outer_momentum)
        return f"{base} + {outer}Ψ (outer)" if outer else base

    @classmethod
    def _outer_bytes(cls, element_size: int, outer_lr, outer_momentum) -> int:
        """DiLoCo's anchor, and its momentum buffer unless the momentum is 0 (torch's SGD keeps none then)."""
        momentum = cls.OUTER_MOMENTUM if outer_momentum is None else outer_momentum
        return 0 if outer_lr is None else element_size * (1 + (momentum > 0))

    @classmethod
    def schedule(cls, s, average_every: int = 4, **options) -> None:
        """Local steps; the all-reduce of the parameters, once every H steps, charged as 1/H per step."""
        plan = s.plan
        s.forward()
        s.backward()
        s.optimizer_step()
        seconds, alpha = plan.collective_s("all_reduce", plan.psi * plan.param_bytes)
        s.blocking_s(seconds / average_every, alpha / average_every)

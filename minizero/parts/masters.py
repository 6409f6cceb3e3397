"""Mixed precision, carried out: the fp32 masters, the loss scaler, and the step around the user's optimizer.

Where the masters live is the stage's business: the reference and DDP keep masters of every parameter; ZeRO keeps
them only for the owned shard (the 16-bit working copy is what ZeRO-1/2/3 all-gather).  What is written once, here,
for all of them (the policy itself is :class:`~minizero.parts.precision.Precision`):

* :class:`LossScaler` -- dynamic loss scaling for fp16, whose range (6e-5 to 65504) cannot hold small gradients:
  the loss is multiplied by a scale S, gradients come out S times larger, and are divided by S in fp32;
* :class:`MasterWeights` -- the master copies and the step around the user's optimizer: unscale into fp32, agree
  on overflow (MAX over ranks, so every rank skips the same step), step, round the result into the working copy.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch
from torch import nn

from ..comm import Comm, ReduceOp, Tag
from .precision import Precision


@dataclass
class LossScaler:
    """Dynamic loss scaling: halve the scale on overflow (the step is skipped), double it after
    ``window`` clean steps in a row, never below ``floor``."""

    scale: float
    window: int
    floor: float
    clean_steps: int = 0  # clean steps since the scale last changed
    skipped_steps: int = 0
    history: list = field(default_factory=list)  # (scale used, skipped) per step

    def update(self, overflow: bool) -> None:
        self.history.append((self.scale, overflow))
        if overflow:
            self.skipped_steps += 1
            self.scale = max(self.scale * 0.5, self.floor)
            self.clean_steps = 0
        else:
            self.clean_steps += 1
            if self.clean_steps == self.window:
                self.scale *= 2.0
                self.clean_steps = 0

    def state_dict(self) -> dict:
        """What a checkpoint keeps: the scale, and where the window and the count of skipped steps stand."""
        return {"scale": self.scale, "clean_steps": self.clean_steps, "skipped_steps": self.skipped_steps}

    def load_state_dict(self, state: dict) -> None:
        self.scale, self.clean_steps, self.skipped_steps = state["scale"], state["clean_steps"], state["skipped_steps"]


def check_half_model(module: nn.Module, precision: Precision, rank: int) -> None:
    """Mixed precision makes the 16-bit copy itself, from the fp32 values that become the masters."""
    for name, p in module.named_parameters():
        if p.is_floating_point() and p.dtype not in (torch.float32, torch.float64):
            raise TypeError(
                f"rank {rank}: parameter {name!r} is already {p.dtype}, but precision={precision.name!r} keeps fp32 "
                f"master weights made from the model's own values -- a 16-bit model has lost those bits. Hand the "
                f"stage the fp32 model (model.float(), or build it in fp32): it makes the {precision.name} working "
                f"copy itself. To train purely in 16 bits instead, leave precision at 'fp32'.")


def check_supported(dtype: torch.dtype, device: torch.device, rank: int) -> None:
    """Refuse a 16-bit dtype the device cannot compute with, before the model is touched."""
    problem = None
    if device.type == "cuda" and not torch.cuda.is_available():
        problem = "this machine has no CUDA device"
    elif device.type == "cuda" and dtype is torch.bfloat16 and not torch.cuda.is_bf16_supported():
        problem = "this GPU has no bf16 arithmetic (it needs compute capability 8.0, Ampere, or newer)"
    else:
        try:
            a = torch.ones(2, 2, dtype=dtype, device=device, requires_grad=True)
            (a @ a).sum().backward()
        except (RuntimeError, TypeError) as error:
            problem = f"a 16-bit matrix product fails there ({str(error).splitlines()[0]})"
    if problem:
        other = "fp16" if dtype is torch.bfloat16 else "bf16"
        raise ValueError(f"rank {rank}: precision {dtype} on {device}: {problem}. Use precision='{other}' if the "
                         f"device computes it, or 'fp32'.")


def cast_parameters(module: nn.Module, dtype: torch.dtype, skip: set[int] = frozenset()) -> dict[int, torch.Tensor]:
    """The working copy: every floating parameter (frozen ones too -- one dtype per forward) in ``dtype``,
    in place, so the parameters stay the objects hooks and optimizers refer to.  Buffers keep their dtype.
    Returns the values as they were, by ``id``: a frozen parameter has no master, and its full-precision
    value must still be what a checkpoint holds."""
    originals = {}
    for p in module.parameters():
        if p.is_floating_point() and id(p) not in skip and id(p) not in originals:
            originals[id(p)] = p.detach().clone()
            p.data = p.data.to(dtype)
    return originals


def in_users_order(rebuilt: torch.optim.Optimizer, user: torch.optim.Optimizer, master: "MasterWeights") -> dict:
    """The rebuilt optimizer's state_dict, indexed as the user's optimizer indexes its parameters (frozen ones
    included), so it loads into a plain optimizer over the unwrapped model."""
    position = {id(p): i for i, p in enumerate(p for group in user.param_groups for p in group["params"])}
    working_of = {id(m): w for w, m in zip(master.working, master.masters, strict=True)}
    order = [position[id(working_of[id(m)])] for group in rebuilt.param_groups for m in group["params"]]
    saved = rebuilt.state_dict()
    return {"state": {order[i]: state for i, state in saved["state"].items()},
            "param_groups": [{**{k: v for k, v in group.items() if k != "params"},
                              "params": [position[id(p)] for p in group["params"]]} for group in user.param_groups]}


class MasterWeights:
    """fp32 master copies of the 16-bit tensors a stage's optimizer steps, and the step around it.

    ``working[i]`` is what backward gives a 16-bit gradient (a parameter, or a
    ZeRO piece); ``masters[i]`` its fp32 master, which the user's optimizer --
    rebuilt over the masters -- actually steps.  One step:

    1. **unscale**: each master's ``.grad`` = the working gradient in fp32,
       divided by the loss scale -- transient, freed after the step;
    2. **agree on overflow**: an inf or NaN anywhere on any rank (a ZeRO rank
       sees only its shard) sets a flag all-reduced with MAX, so every rank
       skips the same step (DeepSpeed's ``has_overflow``);
    3. **step** the masters with the user's optimizer -- or, on overflow,
       touch nothing and halve the scale;
    4. **round** each stepped master into its working copy: the 16-bit
       weights the next forward (and ZeRO's all-gather) uses.

    With ``optimizer_outside`` the user's optimizer was built *after* wrapping, over the masters
    (``stage.parameters()``, as FSDP2's ``MixedPrecisionPolicy`` keeps fp32 sharded parameters for it), and
    steps them itself.  Then the stage hands each synchronised gradient over at once (:meth:`hand_over`:
    unscaled into the masters' ``.grad``, the working one freed, an overflow agreed on and the step skipped
    by setting every master's ``.grad`` to None, which torch's optimizers skip), and rounds the masters
    into the working copy before the next forward (:meth:`refresh`).

    With ``copies`` (:class:`~minizero.parts.offload.HostCopies`) the masters live in host memory -- ZeRO-Offload --
    and every gradient read and parameter written back crosses through it, counted; in fp32 too, where the
    "masters" are fp32 host copies of the shard and there is nothing to round.
    """

    def __init__(self, working: list[torch.Tensor], masters: list[nn.Parameter], precision: Precision,
                 comm: Comm | None = None, tag: Callable[[str], Tag] | None = None,
                 masters_dtype: torch.dtype | None = None, optimizer_outside: bool = False, copies=None):
        self.working, self.masters, self.precision = working, masters, precision
        self.copies = copies  # a HostCopies when the masters are offloaded, else None (same device)
        self.optimizer_outside = optimizer_outside
        self._refreshed = [m._version for m in masters]  # optimizer_outside: each master's version when last rounded
        # Said by the caller where this rank may hold no master at all (a ZeRO rank with an empty shard, a
        # parameter server's worker): the loss must still be computed in the model's dtype, as elsewhere.
        self._masters_dtype = masters_dtype
        self.comm, self.tag = comm, tag or Tag
        self.scaler = (LossScaler(precision.loss_scale, precision.loss_scale_window, precision.min_loss_scale)
                       if precision.scaled else None)
        self._master_of = {id(w): m for w, m in zip(working, masters, strict=True)}
        self._overflow: bool | None = None  # this step's verdict, once unscaled
        #: ``listener(stepped, rescale)`` after every step: was it taken on every rank, and by what factor the
        #: loss scale changed -- compression's error feedback keeps its residuals by it (``Wire.settle``).
        self.settled: list[Callable[[bool, float], None]] = []

    def reset(self) -> None:
        """``zero_grad()``: an unscale whose step never came (clipped, then not stepped) is forgotten."""
        for m in self.masters:
            m.grad = None
        self._overflow = None

    def master_of(self, working: torch.Tensor) -> nn.Parameter:
        return self._master_of[id(working)]

    @property
    def loss_scale(self) -> float:
        return self.scaler.scale if self.scaler else 1.0

    @property
    def skipped_steps(self) -> int:
        return self.scaler.skipped_steps if self.scaler else 0

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        return loss * self.scaler.scale if self.scaler else loss

    @torch.no_grad()
    def unscale_(self) -> bool:
        """The masters' fp32 gradients, unscaled; True if any rank found an inf or NaN.  Once per step:
        clipping calls it before the step, as torch's ``GradScaler.unscale_``."""
        if self.optimizer_outside:  # the masters' gradients were handed over, unscaled, at the end of backward
            return False
        if self._overflow is None:
            inverse = 1.0 / self.loss_scale
            for w, m in zip(self.working, self.masters, strict=True):
                m.grad = None if w.grad is None else self._gradient_of(w, m).mul_(inverse)
            self._overflow = self._agree_on_overflow() if self.scaler else False
        return self._overflow

    def _gradient_of(self, w: torch.Tensor, m: nn.Parameter) -> torch.Tensor:
        """A new tensor: the working gradient in the master's dtype, where the master lives."""
        return self.copies.gradient(w.grad, m.dtype) if self.copies else w.grad.to(m.dtype, copy=True)

    def _round_into(self, w: torch.Tensor, m: nn.Parameter) -> None:
        """The one rounding to 16 bits: the stepped master into its working copy."""
        if self.copies:
            self.copies.write_back(w, m)
        else:
            w.copy_(m)

    def _agree_on_overflow(self) -> bool:
        # The flag is built on the device and all-reduced there; the one host synchronisation of the step is
        # reading the verdict, which the algorithm needs: whether to step at all is decided on the host.
        device = self.masters[0].device if self.masters else torch.device("cpu")
        flag = torch.zeros(1, device=device)
        for m in self.masters:
            if m.grad is not None:
                flag = torch.maximum(flag, (~torch.isfinite(m.grad).all()).to(flag.dtype).reshape(1))
        if self.comm is not None:
            self.comm.all_reduce(flag, ReduceOp.MAX, tag=self.tag("overflow flag"))
        return bool(flag.item() > 0)

    @property
    def masters_dtype(self) -> torch.dtype:
        return self._masters_dtype or (self.masters[0].dtype if self.masters else torch.float32)

    def unscaled_masters(self) -> list[nn.Parameter]:
        """The masters, their ``.grad`` unscaled: what clipping clips (before the step)."""
        self.unscale_()
        return self.masters

    @torch.no_grad()
    def step(self, optimizer_step: Callable[[], None]) -> bool:
        """Unscale, and step the masters with ``optimizer_step`` unless some rank overflowed; True if stepped."""
        overflow, stepped, scale = self.unscale_(), False, self.loss_scale
        try:
            if overflow:
                self._refuse_overflow_at_the_floor()
                return False  # skipped: masters, optimizer states and working copy untouched
            optimizer_step()
            for w, m in zip(self.working, self.masters, strict=True):
                if m.grad is not None:
                    self._round_into(w, m)
            stepped = True
            return True
        finally:
            for m in self.masters:
                m.grad = None  # the fp32 gradients are transient: not model state between steps
            if self.scaler:
                self.scaler.update(overflow)
            self._overflow = None
            for listener in self.settled:
                listener(stepped, self.loss_scale / scale)

    def _refuse_overflow_at_the_floor(self) -> None:
        if self.scaler.scale <= self.scaler.floor:
            rank = self.comm.rank if self.comm else 0
            raise FloatingPointError(
                f"rank {rank}: gradients are inf or NaN even at the minimum loss scale ({self.scaler.floor:g}); "
                f"the run has diverged, not overflowed. Lower the learning rate, check the data for inf/NaN, "
                f"or use precision='bf16' (fp32's range).")

    # ------------------------------------------------------------ the optimizer built after wrapping
    @torch.no_grad()
    def hand_over(self) -> None:
        """After a synchronising backward: each working gradient, in fp32 and unscaled, *added* to its master's
        ``.grad`` (torch's accumulation, in fp32 -- as FSDP2 accumulates sharded gradients), and freed.  With
        loss scaling, the ranks agree on overflow; on overflow every master's ``.grad`` becomes None -- the
        user's ``optimizer.step()`` then skips the step -- and the scale halves."""
        scale = self.loss_scale
        inverse = 1.0 / scale
        for w, m in zip(self.working, self.masters, strict=True):
            if w.grad is not None:
                g = self._gradient_of(w, m).mul_(inverse)
                m.grad = g if m.grad is None else m.grad.add_(g)
                w.grad = None
        overflow = self._agree_on_overflow() if self.scaler else False
        if overflow:
            self._refuse_overflow_at_the_floor()
            for m in self.masters:
                m.grad = None
        if self.scaler:
            self.scaler.update(overflow)
        for listener in self.settled:
            listener(not overflow, self.loss_scale / scale)

    @torch.no_grad()
    def refresh(self) -> bool:
        """Before a forward: round every master the user's optimizer changed into its working copy (the one
        rounding to 16 bits).  True if any changed."""
        changed = False
        for i, (w, m) in enumerate(zip(self.working, self.masters, strict=True)):
            if m._version != self._refreshed[i]:
                self._round_into(w, m)
                self._refreshed[i], changed = m._version, True
        return changed

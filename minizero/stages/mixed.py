"""Mixed precision, as every stage takes it: the checks, the fp32 masters (of every parameter for the reference and
DDP, of the owned shard only for ZeRO: :func:`keep_sharded_masters`), the forward in 16 bits.

These are methods of the stages (``self`` is the stage), written here so each stage's file reads as its lifecycle.
The recipe itself -- the policy, the masters, the loss scaler, overflow agreed across ranks -- is
:mod:`minizero.parts.precision` and :mod:`minizero.parts.masters`.
"""
from __future__ import annotations

import torch
from torch import nn

from ..parts.kept_state import keep_state
from ..parts.masters import cast_parameters, check_half_model, check_supported
from ..parts.rebuilt import rebuild
from .wrap import route


def check_mixed_precision(self) -> None:
    if self.optimizer is not None and type(self.optimizer) is torch.optim.LBFGS:
        raise TypeError(
            f"rank {self.rank}: LBFGS cannot step fp32 master weights: it re-evaluates the loss through a "
            f"closure on the parameters it holds, which under precision={self.precision.name!r} are not the "
            f"model's. Use an element-wise optimizer (SGD, Adam, AdamW, ...) or precision='fp32'.")
    check_half_model(self.module, self.precision, self.rank)
    device = next((p.device for p in self.module.parameters()), torch.device("cpu"))
    check_supported(self.precision.working_dtype, device, self.rank)

def keep_masters(self) -> None:
    """Mixed precision where every rank keeps every parameter (the reference, ddp): fp32 masters of
    all trainable parameters, a 16-bit working copy in the model, and the user's optimizer rebuilt over
    the masters (its ``step`` routed to the stage's, which goes through them).  Without an optimizer (one
    built after wrapping), ``stage.parameters()`` are the masters, as FSDP2's are its fp32 parameters."""
    if not self.precision.mixed:
        return
    optimizer, trainable = self.optimizer, [p for _, p in self.trainable()]
    masters = [nn.Parameter(p.detach().clone()) for p in trainable]
    originals = cast_parameters(self.module, self.precision.working_dtype)
    self._frozen = {k: v for k, v in originals.items() if k not in {id(p) for p in trainable}}
    self.master = self.master_class(trainable, masters, self.precision, self.comm,
                                     self.tag if self.comm else None, optimizer_outside=optimizer is None)
    settle_wire(self)
    if optimizer is None:
        return
    self.master_optimizer = rebuild(type(optimizer), optimizer.defaults, optimizer.param_groups,
                                    [[self.master.master_of(p) for p in group["params"] if p.requires_grad]
                                     for group in optimizer.param_groups])
    # State the optimizer already holds moves to the masters' optimizer, whole (minizero.parts.kept_state).
    keep_state(optimizer, self.master_optimizer,
               lambda p: [(0, p.numel(), self.master.master_of(p))] if p.requires_grad else [])
    route(optimizer, self)

def settle_wire(self) -> None:
    """Compression's error feedback keeps a step's residuals only if every rank took the step (the MAX
    verdict, not this rank's shard: a skipped step's may hold inf - inf), rescaled as the loss scale moves.
    Only loss scaling skips steps, and under it the only wire is the 16-bit one (a codec is refused there);
    masters without scaling -- fp32 offloaded, bf16 -- settle nothing, whatever their wire."""
    wire = getattr(self, "wire", None)
    if wire is not None and self.precision.scaled:
        self.master.settled.append(wire.settle)

def cast_call(self, *args, **kwargs):
    """The model's forward in its working precision: floating inputs cast to 16 bits (FSDP2's
    ``cast_forward_inputs``), floating outputs back to the masters' dtype, so the loss is computed in fp32."""
    if not self.precision.mixed:  # (offloaded fp32 training keeps fp32 "masters" on the host, and no cast)
        return self.module(*args, **kwargs)
    working, full = self.precision.working_dtype, self.master.masters_dtype
    args, kwargs = _cast_floating((args, kwargs), working)
    return _cast_floating(self.module(*args, **kwargs), full)


def _cast_floating(tree, dtype: torch.dtype):
    """Every floating-point tensor in a nest of tuples, lists and dicts, cast to ``dtype``."""
    if isinstance(tree, torch.Tensor):
        return tree.to(dtype) if tree.is_floating_point() else tree
    if isinstance(tree, (tuple, list)):
        return type(tree)(_cast_floating(t, dtype) for t in tree)
    if isinstance(tree, dict):
        return {k: _cast_floating(v, dtype) for k, v in tree.items()}
    return tree


def loss_scale(self) -> float:
    """The loss scale of the next backward (1 without dynamic loss scaling)."""
    return self.master.loss_scale if self.master else 1.0


def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
    """Under fp16 (dynamic loss scaling): ``loss`` times the loss scale, and a hook on it that marks the backward
    running through it, for :func:`check_loss_scaled`."""
    scaled = self.master.scale_loss(loss)
    if scaled.requires_grad:
        scaled.register_hook(lambda grad: setattr(self, "_loss_scaled", True) or grad)
    return scaled


def watch_loss_scaling(self, output) -> None:
    """Under fp16, hook the output so its backward first asks :func:`check_loss_scaled` (registered before the
    stage's own hook, so it runs first: nothing is queued or sent when it refuses)."""
    tensors = output if isinstance(output, (tuple, list)) else [output]
    for tensor in tensors:
        if isinstance(tensor, torch.Tensor) and tensor.requires_grad:
            tensor.register_hook(lambda grad: check_loss_scaled(self))
            return


def check_loss_scaled(self) -> None:
    """In a backward under fp16, as it reaches the stage's output (after the loss's own hook): was the loss scaled?
    If not, every gradient would be divided by a scale never applied -- training 2^16 times too slowly, with no
    error anywhere (a loop ported from FSDP2, which has no loss scaling, does exactly this).  Refused here, before
    any gradient is unscaled or sent."""
    if not self._loss_scaled:
        raise RuntimeError(
            f"rank {self.rank}: backward in fp16 through a loss not scaled by stage.scale_loss(loss): its gradients "
            f"would be divided by the loss scale ({self.loss_scale:g}) that was never applied, and training would go "
            f"{self.loss_scale:g} times too slowly with no error. Call stage.scale_loss(loss).backward() (torch's "
            f"GradScaler.scale), or train in bf16, which needs no loss scaling.")


def skipped_steps(self) -> int:
    """Optimizer steps skipped because some rank's gradients overflowed (fp16)."""
    return self.master.skipped_steps if self.master else 0


def named_parameters(self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True):
    """The model's parameters -- or, under mixed precision with the optimizer built after wrapping, their
    fp32 masters: what that optimizer must step (FSDP2's ``MixedPrecisionPolicy``: fp32 parameters, the
    16-bit copy made for compute)."""
    if not self.masters_outside:
        yield from nn.Module.named_parameters(self, prefix, recurse, remove_duplicate)
        return
    for name, p in self.trainable():
        yield prefix + name, self.master.master_of(p)


def keep_sharded_masters(self) -> None:
    """Mixed precision, ZeRO's way: fp32 masters of the *owned shard* only (12 bytes per parameter for
    Adam, divided by N); the flat buffers -- parameters and what is all-gathered -- become 16-bit.
    Offloaded, the masters are kept in host memory -- in fp32 training too, as plain copies of the shard --
    and the optimizer, built over them, keeps its states there and steps there."""
    dtype = self.precision.working_dtype  # None in fp32: each group keeps its own
    place = {"place": self.host_copies.place} if self.host_copies else {}
    masters = [group.keep_master(dtype or group.dtype, **place) for group in self.groups]
    if dtype is not None:
        self._frozen = cast_parameters(self.module, dtype, skip={id(s.param) for g in self.groups for s in g.segments})
    working = [piece.param for group in self.groups for piece in group.pieces]
    pieces = [nn.Parameter(master[piece.offset:piece.offset + piece.stop - piece.start])
              for group, master in zip(self.groups, masters, strict=True) for piece in group.pieces]
    copies = {"copies": self.host_copies} if self.host_copies else {}  # (a lab's own class need not take it)
    self.master = self.master_class(working, pieces, self.precision, self.comm, self.tag,
                                     masters[0].dtype if masters else None, optimizer_outside=self.user_optimizer is None,
                                     **copies)
    self._settle_wire()

"""Stage ``ddp``: the simplest correct data parallelism.

Every rank holds the whole model and a different share of the global batch.
If all replicas start equal and apply the same update, they stay equal, and
the update equals single-device training on the global batch when it uses
the *average* of the ranks' gradients (the gradient of a mean is the mean of
the gradients).  So:

1. at wrap time, broadcast rank 0's parameters (ranks may have initialised
   differently);
2. when backward finishes, all-reduce the gradients -- one flat buffer per
   dtype -- and divide by N;
3. step the ordinary optimizer, identically on every rank.

Its cost is the ring all-reduce of the gradients: 2(N-1)/N * Psi * b bytes per
rank per step.  Inside ``no_sync()`` nothing is sent and gradients accumulate
locally; the first backward after it averages the accumulated sums (torch's idiom).

Every rank must put the same parameters in the buffer.  A parameter without
a gradient is refused, named -- or, with ``find_unused_parameters=True``, the
ranks first all-reduce a bitmap of who used what (as torch DDP does), so a
parameter used on some ranks only is averaged with zeros and one used nowhere
is not stepped, exactly as on a single device.

``wire="fp16"`` (``WirePolicy(compress="fp16")``, or ``"bf16"``) sends the gradients over a 16-bit wire
instead (:mod:`minizero.compress`): half the bytes, the same mean up to rounding
-- the wire is an argument of the all-reduce, the average stays one line.
"""
from __future__ import annotations

import torch
from torch import nn

from ..comm import Comm, ReduceOp
from ..compress import WirePolicy, make_wire
from ..costs.formulas import all_reduce_bytes
from ..parts.flat import group_by_dtype, pack, unpack
from ..parts.precision import Precision
from .base import Stage
from .facts import Reduction
from .options import WIRE_AND_USE
from .unused import agree_on_use, unused_error
from .wrap import broadcast_module, check_same_model


class DDP(Stage):
    name = "ddp"
    options = WIRE_AND_USE

    def __init__(self, module: nn.Module, optimizer: torch.optim.Optimizer | None = None, comm: Comm | None = None,
                 *, wire: WirePolicy | str = WirePolicy(), find_unused_parameters: bool = False,
                 precision: Precision | str = "fp32"):
        wire = WirePolicy.of(wire, comm.rank if comm else 0)  # before anything changes: a refusal leaves all
        super().__init__(module, optimizer, comm, precision)
        self.find_unused_parameters = find_unused_parameters
        self.wire = make_wire(comm, wire, self.trainable(), self.precision)
        self._names = {id(p): name for name, p in self.trainable()}  # for layout(), every step: looked up once
        check_same_model(module, comm)
        broadcast_module(module, comm)
        self.keep_masters()  # mixed precision: fp32 masters of every parameter, the model in 16 bits

    def post_backward(self) -> None:
        """Backward has finished: average every gradient across ranks, one flat all-reduce per dtype."""
        for dtype, params in group_by_dtype(self._with_gradient()).items():
            grads = [p.grad for p in params]
            flat = pack(grads)
            self.comm.all_reduce(flat, ReduceOp.AVG, tag=self.tag(f"gradients ({str(dtype).replace('torch.', '')})"),
                                 wire=self.wire, key=dtype, layout=self.layout(params))
            unpack(flat, grads)

    def layout(self, params: list[nn.Parameter]) -> list[tuple[str, torch.Size]]:
        """What a flat buffer of ``params`` holds, by name and shape: a wire that compresses each matrix on its
        own (PowerSGD) cuts the buffer by it."""
        return [(self._names[id(p)], p.shape) for p in params]

    def step(self) -> None:
        """Every rank steps the same averaged gradients: the replicas stay equal."""
        with self.stepping():
            self.optimizer_step()

    def _with_gradient(self) -> list[nn.Parameter]:
        """The parameters the flat buffer holds -- the same list on every rank.

        Packing "whatever has a gradient here" would pair rank 0's gradient of one
        parameter with rank 1's of another whenever ranks use different parameters.
        So either every parameter must have a gradient (checked here, no
        communication), or, with ``find_unused_parameters``, the ranks agree first."""
        named = self.trainable()
        if not self.find_unused_parameters:
            missing = [n for n, p in named if p.grad is None]
            if missing:
                raise unused_error(self.rank, missing, "the ranks would disagree on what the flat buffer holds")
            return [p for _, p in named]
        used = agree_on_use(self.comm, [p.grad is not None for _, p in named], self.tag("used-parameter bitmap"))
        for (_, p), anywhere in zip(named, used, strict=True):
            if anywhere and p.grad is None:
                p.grad = torch.zeros_like(p)  # this rank's share of a gradient that exists elsewhere
        return [p for (_, p), anywhere in zip(named, used, strict=True) if anywhere]

    def held_tensors(self) -> dict[str, list[torch.Tensor]]:
        held = super().held_tensors()
        # compression's error feedback (one full-size residual per buffer) and PowerSGD's Qs: beyond the formula
        held["error_feedback"] = self.wire.held() if self.wire else []
        return held

    # ------------------------------------------------------------------ facts
    @classmethod
    def sent_bytes_per_step(cls, psi, world_size, grad_bytes, param_bytes, **options) -> float:
        return all_reduce_bytes(psi * grad_bytes, world_size)  # once per step, however many micro-batches

    @classmethod
    def after_backward_elements(cls, psi, world_size, **options) -> float:
        """post_backward packs every gradient into one flat buffer: a second copy of them for the all-reduce."""
        return psi

    @classmethod
    def schedule(cls, s, **options) -> None:
        """One all-reduce after backward: nothing hides."""
        s.forward()
        s.backward()
        s.blocking("all_reduce", s.plan.psi, s.plan.grad_bytes)
        s.optimizer_step()

    @classmethod
    def reduction(cls, model, optimizer, world_size, **options) -> Reduction:
        """One buffer per dtype; with ``find_unused_parameters`` only what has a gradient on some rank."""
        by_dtype: dict = {}
        for name, p in model.named_parameters():
            if p.requires_grad:
                by_dtype.setdefault(p.dtype, []).append(name)
        return Reduction(list(by_dtype.values()), packs_unused=False)


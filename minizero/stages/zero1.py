"""Stage ``zero1``: optimizer states sharded (ZeRO paper, section 5.1, P_os).

DDP keeps N identical copies of everything.  The optimizer states are the
biggest part (Adam: two fp32 values per parameter) and the optimizer update
is element-wise, so rank ``r`` can update just *its* 1/N of the parameters,
if it has the averaged gradient for that slice, and then share the result:

1. gradients accumulate as in DDP, into one flat (padded) buffer per group;
2. when backward finishes, **reduce-scatter** the buffer: rank ``r`` receives
   the average of its own slice only -- half an all-reduce;
3. the optimizer -- the user's class and hyper-parameters, rebuilt over the
   owned pieces -- updates that slice (states exist for it alone);
4. **all-gather** the updated slices: the other half of an all-reduce.

Bytes: reduce-scatter + all-gather = 2(N-1)/N * Psi * b, exactly DDP's.
ZeRO-1 saves memory, not communication -- and it is the *same* update as DDP
and as single-device training, which the property suite proves.  (An
all-reduce followed by an all-gather, seen in public code, costs 3Psi.)

Memory per rank (fp32 Adam): parameters 4Psi + gradients 4Psi + states 8Psi/N;
in mixed precision (the paper's setting) 2Psi + 2Psi + (4 + 8)Psi/N: the fp32
masters are optimizer state, sharded with the moments.

After the reduce-scatter the owned slice *is* the pieces' ``.grad`` and the
other slices are zeroed -- they were the other ranks' to average.  A backward
without ``zero_grad()`` in between adds to the averaged gradient, as ``.grad``
does in torch: when the next accumulation window opens (at its first forward),
a piece that still holds a gradient moves it into a copy of its own, added back
after the next reduce-scatter -- left in the buffer, only its owner would
contribute it to the mean.  A piece whose ``.grad`` someone set to None starts
from zero.
"""
from __future__ import annotations

import torch
from torch import nn

from ..comm import Comm
from ..compress import reduce_scatter_mean
from ..flat import keep_grad_in
from ..formulas import all_gather_bytes, reduce_scatter_bytes
from ..layout import build_groups, plan_groups
from ..precision import Precision
from .facts import Reduction, Shards
from .options import WIRE_AND_USE
from .zero import ZeRO


class ZeRO1(ZeRO):
    name = "zero1"
    shards = Shards(optimizer_states=True)
    options = WIRE_AND_USE

    def __init__(self, module: nn.Module, optimizer: torch.optim.Optimizer | None = None, comm: Comm | None = None,
                 compress: str | None = None, error_feedback: bool = False, find_unused_parameters: bool = False,
                 precision: str | Precision = "fp32"):
        super().__init__(module, optimizer, comm, compress, error_feedback, find_unused_parameters, precision)
        self.shard(self.layout())
        # ZeRO-1 keeps full gradients, one flat buffer per group; each .grad is a view into it.
        self.grad_buffers = [torch.zeros_like(g.data) for g in self.groups]
        self._slot = {id(s.param): (g, s) for g, group in enumerate(self.groups) for s in group.segments}
        self._window_open = False
        self._zero_grad()
        for group in self.groups:
            for s in group.segments:
                s.param.register_post_accumulate_grad_hook(self._on_gradient_ready)

    def layout(self) -> list:
        """The flat groups, sharded over the N ranks (a parameter server shards them over its S servers)."""
        return build_groups(self.param_groups(), self.rank, self.world_size, self.names())

    # ------------------------------------------------------------ backward
    def forward(self, *args, **kwargs):
        if torch.is_grad_enabled() and not self._window_open:
            self._open_window()
        return super().forward(*args, **kwargs)

    def _open_window(self) -> None:
        """A new accumulation window.  Pieces that still hold a gradient move it out of the buffer into a
        copy of their own until the reduce-scatter -- left in place, only its owner would add it into the
        mean -- and whatever is done to their ``.grad`` meanwhile (zeroed, set to None) is what gets added back."""
        self._window_open = True
        for group, buffer in zip(self.groups, self.grad_buffers):
            owned = group.shard_of(buffer)
            if any(piece.param.grad is not None for piece in group.pieces):
                carried = owned.clone()
                for piece in group.pieces:
                    if piece.param.grad is not None:
                        piece.param.grad = carried[piece.offset:piece.offset + piece.stop - piece.start]
            owned.zero_()

    def _on_gradient_ready(self, param: nn.Parameter) -> None:
        self._used.add(id(param))
        g, s = self._slot[id(param)]
        keep_grad_in(param, self.grad_buffers[g][s.start:s.stop].view(s.shape))

    def sync_gradients(self) -> None:
        """Backward has finished: reduce-scatter each group's gradients into the owned slice, in place."""
        try:
            self._refuse_unused_here(self.groups)
            used = self._agree_on_use([s.param for g in self.groups for s in g.segments])
        finally:
            self._used.clear()
        for index, (group, buffer) in enumerate(zip(self.groups, self.grad_buffers)):
            owned = group.shard_of(buffer)
            self.reduce(buffer, owned, index, [s.name for s in group.segments], tag=self.tag(f"group {index} gradients"))
            lo, hi = group.rank * group.shard_size, (group.rank + 1) * group.shard_size
            buffer[:lo].zero_()  # the other ranks' slices: they averaged them; what accumulates next is new
            buffer[hi:].zero_()
            for piece in group.pieces:
                view = owned[piece.offset:piece.offset + piece.stop - piece.start]
                if piece.param.grad is not None and piece.param.grad.data_ptr() != view.data_ptr():
                    view.add_(piece.param.grad)  # carried from before this window
                    piece.param.grad = view
                elif id(piece.segment.param) in used:
                    piece.param.grad = view
        self._window_open = False

    def reduce(self, buffer: torch.Tensor, owned: torch.Tensor, index: int, names: list[str], tag) -> None:
        """``owned`` gets this rank's slice of the mean of ``buffer``: a reduce-scatter (a parameter server
        pushes instead)."""
        reduce_scatter_mean(self.comm, self.wire, buffer, owned, index, names, tag=tag)

    # ------------------------------------------------------------ optimizer
    def _step(self) -> None:
        if self.optimizer.step_owned():  # pieces without a gradient are skipped, as torch.optim skips None
            self.share_parameters()  # (not after a step skipped for overflow: nothing changed)

    def _zero_grad(self, set_to_none: bool = True) -> None:
        super()._zero_grad(set_to_none)
        self._window_open = False
        for group, buffer in zip(self.groups, self.grad_buffers):
            buffer.zero_()
            for s in group.segments:
                s.param.grad = buffer[s.start:s.stop].view_as(s.param)

    def held_tensors(self) -> dict[str, list[torch.Tensor]]:
        held = super().held_tensors()
        held["grads"] += self.grad_buffers
        return held

    # ------------------------------------------------------------------ facts
    @classmethod
    def sent_bytes_per_step(cls, psi, world_size, grad_bytes, param_bytes, **options) -> float:
        return reduce_scatter_bytes(psi * grad_bytes, world_size) + all_gather_bytes(psi * param_bytes, world_size)

    @classmethod
    def schedule(cls, s, **options) -> None:
        """Reduce-scatter after backward, all-gather after the step: neither hides."""
        s.forward()
        s.backward()
        s.blocking("reduce_scatter", s.plan.psi, s.plan.grad_bytes)
        s.optimizer_step()
        s.blocking("all_gather", s.plan.psi, s.plan.param_bytes)

    @classmethod
    def reduction(cls, model, optimizer, world_size, **options) -> Reduction:
        names = {id(p): n for n, p in model.named_parameters()}
        return Reduction([[names[id(p)] for p in piece]
                          for _, piece in plan_groups([g["params"] for g in optimizer.param_groups])], padded=True)

"""Stage ``zero1``: optimizer states sharded (ZeRO paper, section 5.1, P_os).

DDP keeps N identical copies of everything.  The optimizer states are the
biggest part (Adam: two fp32 values per parameter) and the optimizer update
is element-wise, so rank ``r`` can update just *its* 1/N of the parameters,
if it has the averaged gradient for that slice, and then share the result:

1. gradients accumulate as in DDP, into one flat (padded) buffer per group;
2. when backward finishes, **reduce-scatter** the buffer: rank ``r`` receives
   the average of its own slice only -- half an all-reduce;
3. the optimizer -- the user's class and hyper-parameters, rebuilt over the
   owned shards -- updates that slice (states exist for it alone);
4. **all-gather** the updated slices: the other half of an all-reduce.

Bytes: reduce-scatter + all-gather = 2(N-1)/N * Psi * b, exactly DDP's.
ZeRO-1 saves memory, not communication -- and it is the *same* update as DDP
and as single-device training, which the property suite proves.  (An
all-reduce followed by an all-gather, seen in public code, costs 3Psi.)

Memory per rank (fp32 Adam): parameters 4Psi + gradients 4Psi + states 8Psi/N.

Optimizer semantics are torch's (see :mod:`minizero.sharded_optimizer`): the
optimizer steps one piece per owned parameter, so a parameter without a
gradient anywhere is not stepped.  A parameter without a gradient on this rank
is refused, named -- or, with ``find_unused_parameters=True``, the ranks agree
on a bitmap first, as in DDP.  Your optimizer's ``zero_grad()`` is routed to
the stage's, so whichever you call clears what the stage reduces; ``step()``
without a backward moves nothing.
"""
from __future__ import annotations

import math

import torch
from torch import nn

from ..comm import Comm, ReduceOp
from ..compress import GradientAverager
from ..flat import keep_grad_in
from ..layout import FlatGroup, build_groups
from ..sharded_optimizer import attach_gradients, check_shardable, full_state_dict, shard_optimizer
from .base import Synchronised, unused_error
from .wrap import broadcast_module, check_same_model


class ZeRO1(Synchronised):
    name = "zero1"

    def __init__(self, module: nn.Module, optimizer: torch.optim.Optimizer, comm: Comm,
                 compress: str | None = None, error_feedback: bool = False, find_unused_parameters: bool = False):
        super().__init__(module, optimizer, comm, find_unused_parameters)
        check_shardable(optimizer, self.rank)
        check_optimizer_owns_only_model_parameters(optimizer, module, self.rank)
        self.averager = GradientAverager(comm, compress, error_feedback)
        for name, p in self.trainable():
            self.averager.check_gradient_dtype(name, p.dtype)
        check_same_model(module, comm)
        broadcast_module(module, comm)
        self.groups: list[FlatGroup] = self._build_groups(optimizer)
        self.optimizer = shard_optimizer(optimizer, self.groups)
        self.user_optimizer = optimizer
        self._group_pairs = list(zip(optimizer.param_groups, self.optimizer.param_groups))
        self._last_seen = {id(g): {k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups}
        self._slot = {id(s.param): (g, s) for g, group in enumerate(self.groups) for s in group.segments}
        self._init_gradients()
        for group in self.groups:
            for s in group.segments:
                s.param.register_post_accumulate_grad_hook(self._on_gradient_ready)
        # The sharded optimizer is routed to the stage too (the user's was, in Synchronised): its own step
        # would skip the all-gather, its own zero_grad would leave the gradient buffers full.
        self._shard_step = self.optimizer.step
        self.optimizer.step, self.optimizer.zero_grad = self.step, self.zero_grad

    def _follow_user_optimizer(self) -> None:
        """A learning-rate scheduler (or anything else) may change the user's optimizer's
        hyper-parameters: carry every change over to the sharded optimizer before it steps."""
        for user, sharded in self._group_pairs:
            for key, value in user.items():
                if key != "params" and self._last_seen[id(user)].get(key) is not value:
                    sharded[key] = value
                    self._last_seen[id(user)][key] = value

    def _build_groups(self, optimizer) -> list[FlatGroup]:
        return build_groups(optimizer, self.module, self.rank, self.world_size)

    # ------------------------------------------------------------ gradients
    def _init_gradients(self) -> None:
        """ZeRO-1 keeps full gradients, in one flat buffer per group; .grad are views into it."""
        self.grad_buffers = [torch.zeros_like(g.data) for g in self.groups]
        self.zero_grad()

    def _zero_grad(self, set_to_none: bool = True) -> None:
        self._synced = False  # a new accumulation window
        for group, buffer in zip(self.groups, self.grad_buffers):
            buffer.zero_()
            for s in group.segments:
                s.param.grad = buffer[s.start:s.stop].view_as(s.param)

    def grad_shards(self) -> list[torch.Tensor]:
        """This rank's slice of the averaged gradient, per group (valid after backward)."""
        return [g.shard_of(buffer) for g, buffer in zip(self.groups, self.grad_buffers)]

    def _on_gradient_ready(self, param: nn.Parameter) -> None:
        self._used.add(id(param))
        g, s = self._slot[id(param)]
        keep_grad_in(param, self.grad_buffers[g][s.start:s.stop].view(s.shape))

    # ------------------------------------------------------------ which parameters have a gradient
    def _checked_groups(self) -> list[FlatGroup]:
        """The groups whose parameters must each have a gradient (ZeRO-3 leaves out units nobody called)."""
        return self.groups

    def _checked_params(self) -> list[nn.Parameter]:
        return [s.param for g in self._checked_groups() for s in g.segments]

    def _refuse_unused_here(self) -> None:
        """Without find_unused_parameters, every parameter must have a gradient on every rank (no communication)."""
        if not self.find_unused_parameters:
            missing = [s.name for g in self._checked_groups() for s in g.segments if id(s.param) not in self._used]
            if missing:
                self._used.clear()
                raise unused_error(self.rank, missing, "ZeRO steps the parameters that have one on every rank")

    def sync_gradients(self) -> None:
        """Backward has finished: reduce-scatter each group's gradients into the owned slice, in place."""
        self._check_second_sync()
        self._refuse_unused_here()
        self._agree_on_use(self._checked_params())
        self._synced = True
        for index, (group, buffer) in enumerate(zip(self.groups, self.grad_buffers)):
            self.averager.reduce_scatter(buffer, group.shard_of(buffer), index, [s.name for s in group.segments],
                                         tag=self.tag(f"group {index} gradients"))

    def _check_second_sync(self) -> None:
        """The owned slice now holds an average and the rest local sums: one buffer cannot take a
        second reduce-scatter.  Refuse rather than compute something else."""
        if self._synced:
            self._synced = False
            raise RuntimeError(
                f"rank {self.rank}: zero1 got a second synchronising backward onto gradients it already reduced, "
                f"with no zero_grad() in between (before or after step()). Call zero_grad() -- the stage's or your "
                f"optimizer's -- before each step's first backward, run all but the last micro-batch inside "
                f"no_sync() (train_step does), or use zero2/zero3, which add it up.")

    # ------------------------------------------------------------ optimizer
    def _step(self) -> None:
        self._follow_user_optimizer()
        attach_gradients(self.groups, self.grad_shards(), self._has_grad)
        self._shard_step()  # pieces without a gradient are skipped, as torch.optim skips None
        self._share_updated_parameters()

    def _share_updated_parameters(self) -> None:
        """Everyone gets everyone's updated slice (parameters are views of ``group.data``)."""
        for g, group in enumerate(self.groups):
            if any(id(s.param) in self._has_grad for s in group.segments):
                self.comm.all_gather(group.data, group.shard.detach().clone(),
                                     tag=self.tag(f"group {g} parameters after step"))

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Global-norm clipping with sharded gradients: each rank holds 1/N of the averaged gradient,
        so the norm needs one more collective (SUM of |g|^p, or MAX for the inf-norm), then every rank
        scales its slice -- torch.nn.utils.clip_grad_norm_'s result without ever holding all of it."""
        shards = self.grad_shards()
        dtype = shards[0].dtype if shards else torch.float32
        tag = self.tag("clip norm")
        if math.isinf(norm_type):
            local = torch.stack([s.abs().max() if s.numel() else torch.zeros((), dtype=dtype) for s in shards]).max()
            total = local.reshape(1).clone()
            self.comm.all_reduce(total, ReduceOp.MAX, tag=tag)
        else:
            total = sum((s.abs().pow(norm_type).sum() for s in shards), torch.zeros((), dtype=dtype)).reshape(1)
            self.comm.all_reduce(total, ReduceOp.SUM, tag=tag)
            total = total.pow(1.0 / norm_type)
        coefficient = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        for shard in shards:
            shard.mul_(coefficient)
        return total[0]

    # ------------------------------------------------------------ accounting
    def held_tensors(self) -> dict[str, list[torch.Tensor]]:
        held = super().held_tensors()
        # Storage is what counts: ZeRO-1's shard views count their whole buffers, ZeRO-2's shards
        # themselves -- and any full gradient still alive on a parameter counts too.
        held["grads"] = self.grad_shards() + [p.grad for _, p in self.trainable() if p.grad is not None]
        return held

    # ------------------------------------------------------------ state dicts
    def full_optimizer_state_dict(self) -> dict:
        """The state_dict a plain torch optimizer over the unwrapped model would have; every rank
        gets it, so it loads into ``type(optimizer)(model.parameters(), ...)``."""
        return full_state_dict(self.optimizer, self.user_optimizer.param_groups, self.groups, self.comm)

    def shard_optimizer_state_dict(self) -> dict:
        """This rank's pieces only: what a sharded checkpoint stores per rank."""
        return self.optimizer.state_dict()


def check_optimizer_owns_only_model_parameters(optimizer: torch.optim.Optimizer, module: nn.Module, rank: int) -> None:
    """A parameter the optimizer holds but the model does not gets no gradient and no name: refuse it here."""
    in_model = {id(p) for p in module.parameters()}
    foreign = [(gi, tuple(p.shape)) for gi, g in enumerate(optimizer.param_groups) for p in g["params"]
               if id(p) not in in_model]
    if foreign:
        raise ValueError(
            f"rank {rank}: the optimizer holds {len(foreign)} tensor(s) that are not parameters of the model "
            f"(param group, shape: {foreign[:3]}); ZeRO shards the model's parameters. Build the optimizer "
            f"over model.parameters() -- after any change to the model.")

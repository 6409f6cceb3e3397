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
"""
from __future__ import annotations

import math

import torch
from torch import nn

from ..comm import Comm, ReduceOp
from ..compress import GradientAverager
from ..flat import keep_grad_in
from ..layout import FlatGroup, build_groups, shard_optimizer
from .base import Synchronised, broadcast_module, check_same_model

#: Optimizers whose update is element-wise, so a flat shard is as good as the parameters.
ELEMENTWISE = (torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW, torch.optim.Adamax, torch.optim.Adagrad,
               torch.optim.RMSprop, torch.optim.NAdam, torch.optim.RAdam, torch.optim.ASGD, torch.optim.Rprop)


def check_shardable(optimizer: torch.optim.Optimizer, rank: int) -> None:
    if type(optimizer) not in ELEMENTWISE:
        raise TypeError(
            f"rank {rank}: {type(optimizer).__name__} cannot run on flat shards. ZeRO hands the optimizer one "
            f"flat 1-D slice per group, which is only the same update for element-wise optimizers; one that "
            f"needs each parameter's shape (Adafactor, Shampoo, Muon) or a closure (LBFGS) would compute "
            f"something else. Use one of: {', '.join(c.__name__ for c in ELEMENTWISE)}.")


class ZeRO1(Synchronised):
    name = "zero1"

    def __init__(self, module: nn.Module, optimizer: torch.optim.Optimizer, comm: Comm,
                 compress: str | None = None, error_feedback: bool = False):
        super().__init__(module, optimizer, comm)
        check_shardable(optimizer, self.rank)
        self.averager = GradientAverager(comm, compress, error_feedback)
        for name, p in self.trainable():
            self.averager.check_gradient_dtype(name, p.dtype)
        check_same_model(module, comm)
        broadcast_module(module, comm)
        self._user_param_groups = [dict(g) for g in optimizer.param_groups]  # for the consolidated state_dict
        self.groups: list[FlatGroup] = self._build_groups(optimizer)
        self.optimizer = shard_optimizer(optimizer, self.groups)
        self.user_optimizer = optimizer
        with_shards = [g for i, g in enumerate(optimizer.param_groups) if any(f.group_index == i for f in self.groups)]
        self._group_pairs = list(zip(with_shards, self.optimizer.param_groups))
        self._last_seen = {id(g): {k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups}
        self._used: set[int] = set()
        self._slot = {id(s.param): (g, s) for g, group in enumerate(self.groups) for s in group.segments}
        self._init_gradients()
        for group in self.groups:
            for s in group.segments:
                s.param.register_post_accumulate_grad_hook(self._on_gradient_ready)

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

    def zero_grad(self) -> None:
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

    def _check_all_used(self) -> None:
        """A flat shard cannot skip one parameter the way torch.optim skips a None gradient."""
        unused = [s.name for g in self.groups for s in g.segments if id(s.param) not in self._used]
        self._used.clear()
        if unused:
            raise RuntimeError(
                f"rank {self.rank}: parameter(s) {unused} got no gradient. ZeRO updates flat shards, where "
                f"a parameter without gradient would still be decayed and moved by the optimizer's state, "
                f"unlike on a single device; freeze it with requires_grad_(False) or leave it out of the optimizer.")

    def sync_gradients(self) -> None:
        """Backward has finished: reduce-scatter each group's gradients into the owned slice, in place."""
        self._check_second_sync()
        self._synced = True
        self._check_all_used()
        for index, (group, buffer) in enumerate(zip(self.groups, self.grad_buffers)):
            self.averager.reduce_scatter(buffer, group.shard_of(buffer), index, [s.name for s in group.segments])

    def _check_second_sync(self) -> None:
        """The owned slice now holds an average and the rest local sums: one buffer cannot take a
        second reduce-scatter.  Refuse rather than compute something else."""
        if getattr(self, "_synced", False):
            self._synced = False
            raise RuntimeError(
                f"rank {self.rank}: zero1 got a second synchronising backward before step(). Run all but the "
                f"last micro-batch inside no_sync() (train_step does), or use zero2/zero3, which accumulate it.")

    # ------------------------------------------------------------ optimizer
    def step(self) -> None:
        self._synced = False
        self._follow_user_optimizer()
        for group, shard in zip(self.groups, self.grad_shards()):
            group.shard.grad = shard
        self.optimizer.step()
        for group in self.groups:  # everyone gets everyone's updated slice; parameters are views of group.data
            self.comm.all_gather(group.data, group.shard.detach().clone())

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Global-norm clipping with sharded gradients: each rank holds 1/N of the averaged gradient,
        so the norm needs one more collective (SUM of |g|^p, or MAX for the inf-norm), then every rank
        scales its slice -- torch.nn.utils.clip_grad_norm_'s result without ever holding all of it."""
        shards = self.grad_shards()
        dtype = shards[0].dtype if shards else torch.float32
        if math.isinf(norm_type):
            local = torch.stack([s.abs().max() if s.numel() else torch.zeros((), dtype=dtype) for s in shards]).max()
            total = local.reshape(1).clone()
            self.comm.all_reduce(total, ReduceOp.MAX)
        else:
            total = sum((s.abs().pow(norm_type).sum() for s in shards), torch.zeros((), dtype=dtype)).reshape(1)
            self.comm.all_reduce(total, ReduceOp.SUM)
            total = total.pow(1.0 / norm_type)
        coefficient = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        for shard in shards:
            shard.mul_(coefficient)
        return total[0]

    # ------------------------------------------------------------ accounting
    def held_tensors(self) -> dict[str, list[torch.Tensor]]:
        held = super().held_tensors()
        # Storage is what counts: ZeRO-1's shard views count their whole buffers, ZeRO-2's shards themselves.
        held["grads"] = self.grad_shards()
        return held

    # ------------------------------------------------------------ state dicts
    def full_optimizer_state_dict(self) -> dict:
        """The state_dict a plain torch optimizer over the unwrapped model would have.

        Each state tensor's shards are all-gathered, the padding dropped, and
        the flat result cut back into per-parameter tensors; every rank gets
        it, so it loads into ``type(optimizer)(model.parameters(), ...)``.
        """
        order = [p for group in self._user_param_groups for p in group["params"]]
        index = {id(p): i for i, p in enumerate(order)}
        state: dict[int, dict] = {}
        for group in self.groups:
            shard_state = self.optimizer.state.get(group.shard, {})
            per_param: list[dict] = [{} for _ in group.segments]
            for key in sorted(shard_state):
                value = shard_state[key]
                if torch.is_tensor(value) and value.shape == group.shard.shape:
                    full = value.new_empty(group.shard_size * group.world_size)
                    self.comm.all_gather(full, value.detach().contiguous())
                    for entry, tensor in zip(per_param, group.unpack_full(full)):
                        entry[key] = tensor
                else:  # a scalar such as Adam's step: the same for every parameter of the group
                    for entry in per_param:
                        entry[key] = value.clone() if torch.is_tensor(value) else value
            for s, entry in zip(group.segments, per_param):
                if entry:
                    state[index[id(s.param)]] = entry
        param_groups = [{**{k: v for k, v in group.items() if k != "params"},
                         "params": [index[id(p)] for p in group["params"]]} for group in self._user_param_groups]
        return {"state": state, "param_groups": param_groups}

    def shard_optimizer_state_dict(self) -> dict:
        """This rank's shards only: what a sharded checkpoint stores per rank."""
        return self.optimizer.state_dict()

"""The flat, sharded layout of ZeRO: one idea, used by ZeRO-1, -2 and -3.

A :class:`FlatGroup` lays parameters of one dtype and one optimizer param group end to end in one buffer, padded
with zeros to a multiple of N.  Rank ``r`` *owns* the contiguous **shard** ``[r*S, (r+1)*S)``, ``S = padded / N``
(the ZeRO paper's "partition"); a parameter's **segment** -- its ``[start, stop)`` in the buffer -- may straddle two
ranks (as in DeepSpeed), which is fine because an element-wise optimizer's update of a range does not depend on the
rest.  The parameters become views into the buffer, so an all-gather into it updates the model in place.

The optimizer sees one **piece** per parameter -- the range of it this rank owns, a 1-D view into the shard -- so a
parameter without a gradient is skipped exactly as ``torch.optim`` skips a ``None`` gradient, and Adam's
per-parameter ``step`` is the parameter's own, as in FSDP2.  Padding belongs to no piece: it stays zero.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from .flat import unpack


def padded_size(numel: int, world_size: int) -> int:
    return -(-numel // world_size) * world_size


@dataclass
class Segment:
    """Where one parameter lives in the flat buffer: its ``[start, stop)`` there."""

    name: str
    param: nn.Parameter
    start: int
    stop: int
    shape: torch.Size  # kept: a ZeRO-3 parameter is an empty placeholder between uses


@dataclass
class Piece:
    """The range ``[start, stop)`` (flat, within the parameter) of ``segment`` that this rank owns,
    as a Parameter viewing the owned shard: what the optimizer steps."""

    segment: Segment
    start: int
    stop: int
    param: nn.Parameter
    offset: int  # where it starts in the owned shard


class FlatGroup:
    def __init__(self, named_params: list[tuple[str, nn.Parameter]], rank: int, world_size: int,
                 group_index: int = 0):
        params = [p for _, p in named_params]
        self.group_index = group_index  # which param group of the user's optimizer
        self.rank, self.world_size = rank, world_size
        self.numel = sum(p.numel() for p in params)
        self.shard_size = padded_size(self.numel, world_size) // world_size
        dtype, device = params[0].dtype, params[0].device
        self.data = torch.zeros(self.shard_size * world_size, dtype=dtype, device=device)
        self.segments, offset = [], 0
        for name, p in named_params:
            self.segments.append(Segment(name, p, offset, offset + p.numel(), p.shape))
            offset += p.numel()
        with torch.no_grad():
            for s in self.segments:
                self.data[s.start:s.stop].copy_(s.param.reshape(-1))
        self.master: torch.Tensor | None = None  # mixed precision: the owned shard in fp32 (keep_master)
        self._live_in(self.data)

    def _live_in(self, data: torch.Tensor) -> None:
        """The parameters become views into ``data``; the owned shard and its pieces are cut from it."""
        self.data = data
        for s in self.segments:
            s.param.data = data[s.start:s.stop].view(s.shape)
        self.shard = self._keep(self.shard_of(data))  # the owned shard
        self.pieces = self._cut_pieces()

    def keep_master(self, working_dtype: torch.dtype, place=torch.Tensor.clone) -> torch.Tensor:
        """Mixed precision: the owned shard's values, still fp32, become the **master shard** (what the
        optimizer steps); the buffer -- the parameters the model computes with, and what is all-gathered --
        becomes their 16-bit working copy.  ``place``: where the master is kept (offload: a host copy,
        :meth:`~minizero.parts.offload.HostCopies.place`).  Returns the master shard."""
        self.master = place(self.shard.detach())
        self._live_in(self.data.to(working_dtype))
        return self.master

    def _keep(self, owned: torch.Tensor) -> torch.Tensor:
        """The owned shard as this group keeps it: a view into the full buffer (ZeRO-1/2)."""
        return owned

    def _cut_pieces(self) -> list[Piece]:
        """One Parameter per parameter that overlaps the owned range, viewing ``self.shard``.
        A zero-size parameter gets an empty piece on the rank whose range holds its offset."""
        lo, hi = self.rank * self.shard_size, (self.rank + 1) * self.shard_size
        pieces = []
        for s in self.segments:
            a, b = max(s.start, lo), min(s.stop, hi)
            owner_of_empty = s.start == s.stop and min(s.start // max(self.shard_size, 1), self.world_size - 1) == self.rank
            if a < b or owner_of_empty:
                a, b = (a, b) if a < b else (s.start, s.start)
                pieces.append(Piece(s, a - s.start, b - s.start, nn.Parameter(self.shard[a - lo:b - lo]), a - lo))
        return pieces

    #: Held whole by every rank, averaged by an all-reduce (:class:`~minizero.parts.unit_plan.ReplicatedGroup`), not sharded.
    replicated = False

    @property
    def gathered(self) -> bool:
        """The full buffer exists: always, but for ZeRO-3's sharded groups between uses."""
        return True

    @property
    def dtype(self) -> torch.dtype:
        return self.shard.dtype

    @property
    def optimizer_dtype(self) -> torch.dtype:
        """The dtype the optimizer steps (and keeps its states) in: the master's, if there is one."""
        return (self.master if self.master is not None else self.shard).dtype

    @property
    def full_bytes(self) -> int:
        """Bytes of the whole flat buffer, padding included: what one all-gather of the group fills."""
        return self.shard_size * self.world_size * self.shard.element_size()

    @property
    def padding(self) -> int:
        return self.shard_size * self.world_size - self.numel

    def shard_of(self, full: torch.Tensor) -> torch.Tensor:
        """This rank's shard of a full-size flat tensor."""
        return full[self.rank * self.shard_size:(self.rank + 1) * self.shard_size]

    def pack_grads(self, out: torch.Tensor | None = None) -> torch.Tensor:
        """The parameters' gradients, flat and padded (zeros where a gradient is None)."""
        out = self.shard.new_zeros(self.shard_size * self.world_size) if out is None else out.zero_()
        for s in self.segments:
            if s.param.grad is not None:
                out[s.start:s.stop].copy_(s.param.grad.reshape(-1))
        return out

    def take_gradients(self) -> torch.Tensor:
        """The parameters' gradients packed into a new flat buffer (:meth:`pack_grads`), and the gradients
        freed: ZeRO-2 and -3 hold no full gradient beyond the moment its bucket is reduce-scattered."""
        full = self.pack_grads()
        for s in self.segments:
            s.param.grad = None
        return full

    def unpack_full(self, full: torch.Tensor) -> list[torch.Tensor]:
        """Per-parameter tensors from a full flat tensor (a consolidated state, say)."""
        out = [full.new_empty(s.shape) for s in self.segments]
        unpack(full[: self.numel], out)
        return out

    def flatten(self, values: list[torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
        """The reverse of :meth:`unpack_full`: per-parameter values laid into one padded flat tensor."""
        full = torch.zeros(self.shard_size * self.world_size, dtype=dtype, device=self.shard.device)
        for s, value in zip(self.segments, values, strict=True):
            full[s.start:s.stop].copy_(value.reshape(-1))
        return full

    @torch.no_grad()
    def load_full(self, full: torch.Tensor) -> None:
        """Take the values of a full flat tensor (a checkpoint's, in fp32): the master shard keeps its own range,
        the buffer -- in place, so every view stays valid -- their cast."""
        if self.master is not None:
            self.master.copy_(self.shard_of(full))
        self.data.copy_(full)


def plan_groups(param_groups: list[list[nn.Parameter]], max_numel: int | None = None) -> list[tuple[int, list]]:
    """Which parameters go into which flat group: ``(param group index, parameters)``.

    One group per optimizer param group and dtype, trainable parameters only;
    with ``max_numel`` (bucketed reduce-scatter) groups of at most that many
    elements, in reverse registration order -- the order backward produces
    gradients."""
    plan = []
    for index, params in enumerate(param_groups):
        params = [p for p in params if p.requires_grad]
        groups: list[list[nn.Parameter]] = []
        for p in reversed(params) if max_numel else params:
            if not groups or groups[-1][0].dtype != p.dtype or (
                    max_numel and sum(q.numel() for q in groups[-1]) + p.numel() > max_numel):
                groups.append([])
            groups[-1].append(p)
        plan += [(index, members) for members in groups]
    return plan


def build_groups(param_groups: list[dict], rank: int, world_size: int, names: dict[int, str] | None = None,
                 max_numel: int | None = None, group_class: type | None = None) -> list[FlatGroup]:
    """The flat groups of an optimizer's ``param_groups`` (see :func:`plan_groups`); ``names`` maps
    ``id(param)`` to its name in the model, for error messages and state dicts."""
    names = names or {}
    plan = plan_groups([g["params"] for g in param_groups], max_numel)
    return [(group_class or FlatGroup)([(names.get(id(p), f"param {i}"), p) for i, p in enumerate(members)], rank,
                                       world_size, index)
            for index, members in plan]

"""The flat group ZeRO-3's units gather and free: only the owned shard persists, the full buffer lives only while
the unit is gathered (FSDP's sharded parameter).  It is a :class:`~minizero.parts.layout.FlatGroup` -- the same
segments, shards and pieces as ZeRO-1 and -2 -- with that one change.  (The replicated modules' groups, kept whole,
are :class:`~minizero.parts.unit_plan.ReplicatedGroup`.)
"""
from __future__ import annotations

import torch

from .layout import FlatGroup


class FreedBuffer(RuntimeError):
    """A gathered buffer handed to :meth:`ShardedFlatGroup.use` after its unit resharded: its storage is freed."""


class ShardedFlatGroup(FlatGroup):
    """ZeRO-3's group: only the owned shard persists.

    The full buffer holds memory only between :meth:`full_buffer` (the gather
    writes into it) and :meth:`reshard`; in between, the parameters point at
    empty placeholders, so a forward through an ungathered unit fails loudly
    instead of computing with stale weights.

    The pitfall: autograd does not save only *parameters* for backward.  A
    linear layer on a batch of sequences saves ``weight.t()`` -- a view of the
    full buffer, which pointing the parameters elsewhere does not free: every
    unit's full parameters would stay allocated from its forward to its
    backward, the whole model at once.  So resharding frees the buffer's
    storage *in place* (``untyped_storage().resize_(0)``) and the next gather
    refills the same storage: every view autograd saved sees the gathered
    values again by backward.  FSDP frees its unsharded parameters the same way.
    """

    def __init__(self, named_params, rank: int, world_size: int, group_index: int = 0):
        super().__init__(named_params, rank, world_size, group_index)
        self.data = None
        self._full = None  # the full buffer, kept for its storage: allocated while gathered, resized to 0 between
        self.reshard()

    def keep_master(self, working_dtype: torch.dtype, place=None) -> torch.Tensor:
        """The owned shard (its own storage) becomes the fp32 master; a 16-bit copy of it is what is kept
        and all-gathered.  Offloaded (``place``), the master is a host copy and the shard stays the device's."""
        self.master = self.shard if place is None else place(self.shard)
        self.shard = self.shard.to(working_dtype)
        self.pieces = self._cut_pieces()
        self.reshard()
        self._full = None  # gathered in the working dtype from now on
        return self.master

    def _keep(self, owned: torch.Tensor) -> torch.Tensor:
        return owned.detach().clone()  # its own storage: the only copy kept

    @property
    def gathered(self) -> bool:
        return self.data is not None

    @torch.no_grad()
    def load_full(self, full: torch.Tensor) -> None:
        """Only the owned shard persists: it (and the master) keep their range; nothing else is held."""
        if self.master is not None:
            self.master.copy_(self.shard_of(full))
        self.shard.copy_(self.shard_of(full))

    def full_buffer(self) -> torch.Tensor:
        """The full buffer, its storage allocated, for a gather to write into (main thread, before the gather
        starts): the same storage every time, so that what autograd saved of it is refilled too.  A group still
        gathered (a unit gathered again while one of its groups was freed) gets a buffer of its own: its live one
        may be computing, and may be freed while the gather writes."""
        numel = self.shard_size * self.world_size
        if self.gathered:
            return self.shard.new_empty(numel)
        if self._full is None:
            self._full = self.shard.new_empty(numel)
        storage = self._full.untyped_storage()
        if storage.nbytes() == 0:
            storage.resize_(numel * self._full.element_size())
        return self._full

    def use(self, full: torch.Tensor) -> None:
        """Point the parameters into a gathered buffer (main thread).  A buffer freed since its gather is refused:
        it holds no values at all now, not even the stale ones a kept gather result once held."""
        if full.untyped_storage().nbytes() < full.numel() * full.element_size():
            raise FreedBuffer(
                f"rank {self.rank}'s {self.segments[0].name} (flat group {self.group_index}): use() was handed a "
                f"buffer freed when its unit last resharded -- a gather's result used again, whose values, kept, would "
                f"be the old gather's, never moved by the optimizer steps since. Start a new all-gather for every "
                f"forward and backward (Unit.unshard: start_gather, then the result, once) and let it go after use()")
        if full.numel() != self.shard_size * self.world_size or full.dtype != self.shard.dtype:
            raise ValueError(
                f"rank {self.rank}'s {self.segments[0].name} (flat group {self.group_index}): use() was handed a "
                f"buffer of {full.numel()} {full.dtype} elements; this group gathers {self.shard_size * self.world_size} "
                f"{self.shard.dtype} ones -- another group's buffer? A unit's gather returns one buffer per group, "
                f"in the groups' order: hand each group its own")
        self.data = full
        for s in self.segments:
            s.param.data = full[s.start:s.stop].view(s.shape)

    def reshard(self) -> None:
        """Free the full buffer's memory in place (see the class): the parameters keep their shapes' names but
        no memory, and no view of the buffer keeps any."""
        self.data = None
        if self._full is not None:
            self._full.untyped_storage().resize_(0)
        for s in self.segments:
            s.param.data = torch.empty(0, dtype=self.shard.dtype, device=self.shard.device)

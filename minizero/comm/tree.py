"""An all-reduce on a binomial tree, built from ``send``/``recv``: reduce to rank 0, broadcast back down.

The ring (:mod:`.ring`) sends each rank only ``2(N-1)/N`` of the tensor, but in ``2(N-1)`` steps, one after
another: each step pays a message's latency ``alpha`` before its bytes flow.  For a small tensor on many ranks
latency is the whole cost, and a tree pays it ``2 ceil(log2 N)`` times instead.

**Which tree, and why this one.**  The *binomial* tree rooted at rank 0:

* *reduce*, round ``k = 0, 1, ...``: every rank whose lowest set bit is ``2^k`` sends its partial result to rank
  ``r - 2^k`` and is done; that rank combines it with its own.  The ranks still holding a partial halve every
  round, so after ``ceil(log2 N)`` rounds rank 0 holds the reduction.  A partner past the last rank is simply
  absent: N = 3 needs nothing special.
* *broadcast*: the same tree backwards.  Rank ``r`` receives from ``r - lowbit(r)``, then sends to ``r + 2^k``
  for each ``2^k`` below ``lowbit(r)`` (every ``2^k < N`` for rank 0), **farthest child first**: that child
  heads the deepest subtree, so it must start forwarding soonest.

In every round a rank sends at most one message and receives at most one -- the alpha-beta model's rule: a
port carries one message at a time each way -- so the critical path is ``2 ceil(log2 N)`` rounds
(:func:`tree_rounds`; the ring's is ``2(N-1)``, each of its steps a send and a receive at once).  The alternatives:
a binary *heap* tree (children ``2r+1``, ``2r+2``) makes each parent take two messages per level, two rounds
per level; *recursive doubling* (every rank exchanges with ``r XOR 2^k``) needs ``log2 N`` rounds but only for
powers of two -- N = 3 needs an extra step folding the odd rank in and out.

**Bytes.**  Every message is the whole tensor of ``S`` bytes: rank ``r`` sends it once up (unless it is the
root) and once to each child (:func:`tree_bytes_sent`).  All ranks together send ``2(N-1) S`` -- every rank but
the root receives the tensor once in each phase, the least a reduce-then-broadcast can move -- and the root
sends ``ceil(log2 N) S`` (at most ``2S`` for N <= 4), against the ring's ``2(N-1)/N S`` per rank: the tree
trades bandwidth for latency.  (NCCL's answer to that is the *double* binary tree: two trees, each carrying
half of the tensor, in which every rank is a leaf in one of them.)

Only the all-reduce is a tree; the other collectives are the ring's (this class is a ring with another
all-reduce), so any stage runs over it.
"""
from __future__ import annotations

import math

import torch

from .collective import ReduceOp, collective
from .placement import on_device
from .ring import RingComm


def tree_rounds(world_size: int) -> int:
    """Rounds on the critical path of a binomial-tree all-reduce: ``ceil(log2 N)`` up, as many down."""
    return 2 * math.ceil(math.log2(world_size)) if world_size > 1 else 0


def lowest_bit(rank: int, world_size: int) -> int:
    """``2^k`` for rank ``r``'s lowest set bit -- the round it leaves the reduce in; for rank 0, the first power
    of two at or above N (the root never leaves)."""
    return rank & -rank if rank else 1 << max(world_size - 1, 0).bit_length()


def tree_children(rank: int, world_size: int) -> list[int]:
    """The ranks ``rank`` sends to in the broadcast, farthest first."""
    low = lowest_bit(rank, world_size)
    return [rank + bit for bit in (1 << k for k in reversed(range(low.bit_length() - 1))) if rank + bit < world_size]


def tree_bytes_sent(numel: int, element_size: int, world_size: int, rank: int) -> int:
    """Bytes rank ``rank`` sends in one binomial-tree all-reduce: the whole tensor up once (not the root) and down
    once per child; nothing for an empty tensor."""
    size = numel * element_size
    return size * ((1 if rank else 0) + len(tree_children(rank, world_size))) if world_size > 1 else 0


class TreeComm(RingComm):
    """The ring's communication layer with a binomial-tree all-reduce (see the module's docstring)."""

    name = "tree"

    # ------------------------------------------------------ the two phases
    def _tree_reduce(self, tensor: torch.Tensor, op: ReduceOp) -> None:
        """Leave in rank 0's ``tensor`` the reduction over all ranks (others keep a partial: the broadcast
        overwrites it).  Round ``k``: a rank whose lowest set bit is ``2^k`` sends its partial to ``r - 2^k`` and
        is done; a rank below that receives from ``r + 2^k``, if there is one, and combines."""
        n, r = self.world_size, self.rank
        incoming = None
        bit = 1
        while bit < n:
            self._at("gather to root", bit.bit_length() - 1)  # (the progress board's name for it)
            if r & bit:
                self._send(tensor, r - bit)
                return
            if r + bit < n:
                incoming = self._scratch(tensor.numel(), tensor)[0] if incoming is None else incoming
                self._recv(incoming, r + bit)
                op.combine(tensor, incoming, out=tensor)
            bit <<= 1

    def _tree_broadcast(self, tensor: torch.Tensor) -> None:
        """Rank 0's ``tensor`` to every rank, down the same tree: receive from the parent, then send to each
        child, farthest first."""
        r = self.rank
        self._at("broadcast")
        if r:
            self._recv(tensor, r - lowest_bit(r, self.world_size))
        for child in tree_children(r, self.world_size):
            self._send(tensor, child)

    # -------------------------------------------------------- the collective
    @collective("all_reduce")
    @on_device(point_to_point=True)
    def all_reduce(self, tensor: torch.Tensor, op: ReduceOp = ReduceOp.SUM) -> None:
        """Reduce to rank 0, (AVG) divide there -- once, before the result is copied N-1 times -- broadcast."""
        flat = tensor.view(-1)
        self._tree_reduce(flat, op)
        if op is ReduceOp.AVG and self.rank == 0:
            flat.div_(self.world_size)
        self._tree_broadcast(flat)

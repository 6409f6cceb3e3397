"""Lab tree -- an all-reduce on a binomial tree, from send/recv (lessons/02_latency_and_scale.ipynb, its end).
Guided level: each method says what to do and which parts exist; the contract level states only what must hold.

The ring all-reduce moves few bytes per rank but takes 2(N-1) steps, one after another, and each step pays a
message's latency.  Write the two phases of a tree all-reduce instead: reduce up a binomial tree to rank 0, then
broadcast back down it -- 2 ceil(log2 N) rounds.  Given: ``all_reduce``, which calls your ``_tree_reduce``,
divides rank 0's tensor by N for AVG, then calls your ``_tree_broadcast``; every other collective (the ring's).

Check it:   python -m minizero check tree --impl THIS_FILE
(or, in a notebook:  from minizero.course.labs import check; check("tree", impl="THIS_FILE"))
The checker compares every result with the exact one, replays the order of every message your ranks sent and
received to count the rounds on the critical path (at most 2 ceil(log2 N): 2, 4, 4 at N = 2, 3, 4), counts each
rank's bytes against the binomial tree's, and trains DDP over your tree against single-device training.
"""
from __future__ import annotations

import torch

from minizero.comm import ReduceOp
from minizero.course.labs.given import Tree as GivenTree


class Tree(GivenTree):
    def _tree_reduce(self, tensor: torch.Tensor, op: ReduceOp) -> None:
        """Leave in rank 0's ``tensor`` the reduction over all ranks of ``tensor`` (the other ranks' may end as
        partial results: the broadcast overwrites them).

        Work in rounds k = 0, 1, 2, ... while 2^k < N.  In round k, the ranks whose lowest set bit is 2^k send
        what they hold to the rank 2^k below them and are done; a rank none of whose bits up to 2^k is set
        receives from the rank 2^k above it -- when there is one (N need not be a power of two) -- and combines
        what arrives into its own tensor.  Half of the ranks still holding a partial drop out every round.

        The parts you have: ``self.rank`` and ``self.world_size``; ``self._send`` and ``self._recv`` (one message
        to or from one rank, blocking; the ledger counts what ``_send`` sends); ``op.combine`` (how two partial
        results meet: a sum, or a max); a receive buffer of your own.
        """
        raise NotImplementedError("write Tree._tree_reduce: rank 0's tensor = the reduction over ranks, up the "
                                  "binomial tree in ceil(log2 N) rounds")

    def _tree_broadcast(self, tensor: torch.Tensor) -> None:
        """Copy rank 0's ``tensor`` into every rank's, down the same tree.

        A rank r > 0 first receives, straight into ``tensor``, from the rank it sent to in the reduce; then every
        rank sends to its children -- the ranks that sent to it in the reduce -- **farthest first**: the farthest
        child heads the deepest subtree, so it must start forwarding soonest (nearest first costs a round).
        """
        raise NotImplementedError("write Tree._tree_broadcast: rank 0's tensor to every rank, down the binomial "
                                  "tree in ceil(log2 N) rounds")

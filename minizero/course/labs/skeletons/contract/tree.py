"""Lab tree -- an all-reduce on a binomial tree, from send/recv (lessons/02_latency_and_scale.ipynb, its end).

Contract level: each method states what must hold after it runs and what the checker holds it to -- not how.
(The guided level says how the tree is laid out and which parts exist: ``python -m minizero lab tree FILE
--level guided``.)

The ring all-reduce moves few bytes per rank but takes 2(N-1) steps, one after another; every step pays a
message's latency.  You write an all-reduce whose critical path is 2 ceil(log2 N) messages long: a reduce up
the *binomial tree* rooted at rank 0, then a broadcast back down it.  Your base, ``minizero.course.labs.given.Tree``, is
the package's communication layer without those two phases; its ``all_reduce`` calls ``_tree_reduce``, then (AVG)
divides rank 0's tensor by N, then calls ``_tree_broadcast``.  Every other collective is the ring's.

The binomial tree rooted at 0: rank r > 0's parent is r - lowbit(r) (lowbit(r): r's lowest set bit, 2^k); its
children are r + 2^j for each 2^j below lowbit(r) -- for rank 0, each 2^j < N -- that are below N.  For N = 4:
0 has children 2 and 1, and 2 has child 3.

Messages: ``self._send(tensor, dst)`` and ``self._recv(tensor, src)`` (blocking; an empty tensor is not sent);
the byte ledger counts what ``_send`` sends.  ``self.rank`` is r, ``self.world_size`` is N.

The checker's properties, in order:
  1. your methods are what runs: both are defined in this file and called while a stage trains over your tree;
  2. every all-reduce's result: SUM, AVG and MAX on drawn world sizes 1-4 and tensors of 0-40 elements, float64
     and float32, integer values (every sum exact) -- every element on every rank exactly what it must be;
  3. rounds and bytes, at N = 1-4: the rounds on the critical path -- the order of every rank's sends and
     receives replayed under the one-port rule (per round a rank sends at most one message and receives at most
     one; a message is received no earlier than the round it left in; a blocking send or receive finishes before
     the rank's next message leaves) -- at most 2 ceil(log2 N): 0, 2, 4, 4; and each rank's bytes
     the binomial tree's: the whole tensor once to its parent (not rank 0) and once to each child;
  4. ddp and ddp-bucketed trained over your tree equal single-device training (N = 3 and 4, K = 2, float64).

Check it:   python -m minizero check tree --impl THIS_FILE
"""
from __future__ import annotations

import torch

from minizero.comm import ReduceOp
from minizero.course.labs.given import Tree as GivenTree


class Tree(GivenTree):
    def _tree_reduce(self, tensor: torch.Tensor, op: ReduceOp) -> None:
        """Called on every rank at once, with a flat tensor of the same size everywhere.

        After it: rank 0's ``tensor`` holds, element by element, the reduction by ``op`` (``op.combine(a, b,
        out=...)``: a sum for SUM and AVG, a max for MAX) of every rank's ``tensor``.  Other ranks' tensors may
        hold anything (the broadcast overwrites them).  Holds at N = 1 too.
        Cost: ceil(log2 N) rounds; rank r > 0 sends the tensor once, to its parent; rank 0 sends nothing.
        """
        raise NotImplementedError("write Tree._tree_reduce: rank 0's tensor = the reduction over ranks, up the "
                                  "binomial tree in ceil(log2 N) rounds")

    def _tree_broadcast(self, tensor: torch.Tensor) -> None:
        """Called on every rank at once.  After it: every rank's ``tensor`` holds rank 0's.
        Cost: ceil(log2 N) rounds; each rank sends the tensor once to each of its children.
        """
        raise NotImplementedError("write Tree._tree_broadcast: rank 0's tensor to every rank, down the binomial "
                                  "tree in ceil(log2 N) rounds")

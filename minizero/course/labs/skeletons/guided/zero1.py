"""Lab 7 -- ZeRO-1's step: reduce-scatter, step the owned shard, all-gather (lessons/07_zero1.ipynb).
Guided level: each method says what to do and which parts exist; the contract level states only what must hold.

Given: the flat sharded layout (``self.groups``: one ``FlatGroup`` per optimizer
param group and dtype, cut at ``bucket_mb``, padded to a multiple of N, each rank owning one shard of
``group.shard_size`` elements), the full gradients (``self.full_grads``: one flat
buffer per group in ``self.full_grads.buffers``, each ``.grad`` a view into it),
the pieces (this rank's range of each parameter, a view into the owned shard), the
user's optimizer rebuilt over the pieces (``self.optimizer``), and ``step``.
Yours: ``post_backward`` -- the gradients' reduce-scatter -- and
``all_gather_parameters``, the sharing of the updated parameters.

Check it:   python -m minizero check zero1 --impl THIS_FILE
Besides equivalence, the checker counts your bytes -- a reduce-scatter plus an
all-gather, 2(N-1)/N x Psi x b, exactly DDP's -- and the optimizer state each
rank holds: 1/N of DDP's.
"""
from __future__ import annotations

from minizero.course.labs.given import ZeRO1 as GivenZeRO1


class ZeRO1(GivenZeRO1):
    def post_backward(self) -> None:
        """Backward has finished on every rank: give each piece, as ``.grad``, its range of the gradient averaged
        over ranks -- with half an all-reduce.

        1. find which parameters got a gradient (those the optimizer steps): the base's ``used_anywhere``
           (over every group's segments) -- with ``find_unused_parameters`` the ranks agree on it;
        2. for each group and its full gradient buffer, reduce-scatter the buffer, averaged, through
           ``self.comm`` into this rank's shard of that same buffer (``group.shard_of``): rank r's shard
           receives the mean of every rank's shard r.  Average over the stage's wire, ``self.wire``, with the
           group's index as its ``key``; label it with ``self.tag(...)``;
        3. hand each shard to the pieces: ``self.full_grads`` has the method that makes each piece's range of
           the averaged shard its ``.grad`` (for the parameters found in 1) and zeroes the other ranks' shards;
        4. when every group is done, close the accumulation window (``self.full_grads.window_open``): the next
           forward opens a new one.
        """
        raise NotImplementedError("write ZeRO1.post_backward: reduce-scatter each group's gradient buffer into the "
                                  "owned shard and hand it to the pieces")

    # Given, in the base: ``step()`` steps the owned pieces -- unless fp16 overflowed, when nothing changed -- and
    # then calls your ``all_gather_parameters()`` to share them.

    def all_gather_parameters(self) -> None:
        """Every rank stepped only its own shard; every rank needs every updated parameter for the next forward.

        1. for each group, all-gather the owned shard (``group.shard``) into the full flat parameters
           (``group.data``, which the parameters are views into) through ``self.comm``.  The shard is a view
           into the very buffer the all-gather writes: send a copy of it;
        2. then tell the base the full parameters are current (``self.remember_shared()``) -- without it the
           next forward sees shards changed since the last all-gather (as after an optimizer the stage does not
           drive) and all-gathers them again: a third Psi of bytes.
        """
        raise NotImplementedError("write ZeRO1.all_gather_parameters: all-gather each group's updated shard")

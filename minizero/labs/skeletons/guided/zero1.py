"""Lab 5 -- ZeRO-1's step: reduce-scatter, step the owned shard, all-gather (lessons/05_zero1.ipynb).

Given: the flat sharded layout (``self.groups``: one ``FlatGroup`` per optimizer
param group and dtype, padded to a multiple of N, each rank owning one shard of
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

from minizero.labs.given import ZeRO1 as GivenZeRO1


class ZeRO1(GivenZeRO1):
    def post_backward(self) -> None:
        """Backward has finished on every rank: give each piece, as ``.grad``, its range of the gradient averaged
        over ranks -- with half an all-reduce.

        1. which parameters got a gradient (those the optimizer steps):
           ``used = self.used_anywhere([s.param for group in self.groups for s in group.segments])``;
        2. for each group ``group`` (index ``index``) and its full gradient buffer ``buffer``
           (``zip(self.groups, self.full_grads.buffers)``), reduce-scatter the buffer into this rank's shard of
           it, averaged over ranks:
           ``self.comm.reduce_scatter(group.shard_of(buffer), buffer, ReduceOp.AVG,
           tag=self.tag(f"group {index} gradients"), wire=self.wire, key=index)`` (``minizero.comm.ReduceOp``).
           The output is a view of the input: rank r's shard of the buffer,
           ``buffer[r * group.shard_size:(r + 1) * group.shard_size]``, receives the mean of every rank's shard r;
        3. hand it over: ``self.full_grads.take_averaged(index, used)`` makes each piece's range of the averaged
           shard its ``.grad`` (pieces of parameters in ``used``) and zeroes the other ranks' shards of the
           buffer -- they own those averages;
        4. when every group is done, ``self.full_grads.window_open = False``: the next forward opens a new
           accumulation window.
        (The package's answer first names a parameter without a gradient on this rank,
        ``self.refuse_unused_here(self.groups)``; the training loop the checker runs never leaves one out.)
        """
        raise NotImplementedError("write ZeRO1.post_backward: reduce-scatter each group's gradient buffer into the "
                                  "owned shard and hand it to the pieces")

    def step(self) -> None:
        """Given, as the package's: step the owned pieces (False: a step skipped for fp16 overflow -- nothing
        changed), then share them with your all-gather."""
        with self.stepping():
            if self.optimizer.step_owned():
                self.all_gather_parameters()

    def all_gather_parameters(self) -> None:
        """Every rank stepped only its own shard; every rank needs every updated parameter for the next forward.

        1. for each group (index ``g``), all-gather its owned shard into the full flat parameters ``group.data``
           (the parameters are views into it):
           ``self.comm.all_gather(group.data, group.shard.detach().clone(), tag=self.tag(f"group {g} parameters"))``
           (the clone: ``group.shard`` is a view into ``group.data``, which the all-gather writes);
        2. then ``self.remember_shared()``: the full parameters are current.  (Without it the next forward sees
           the shards changed since the last all-gather -- as after an optimizer the stage does not drive -- and
           all-gathers them again: a third Psi of bytes.)
        (The package's answer skips a group none of whose parameters had a gradient anywhere: it did not change.)
        """
        raise NotImplementedError("write ZeRO1.all_gather_parameters: all-gather each group's updated shard")

"""Lab 7 -- ZeRO-1's step: reduce-scatter, step the owned shard, all-gather (lessons/07_zero1.ipynb).

Contract level: each method states what must hold after it runs and what the checker holds it to -- not how.
(The guided level says which parts of minizero exist for it: ``python -m minizero lab zero1 FILE --level guided``.)

You write the gradients' reduce-scatter (``post_backward``) and the sharing of the updated parameters
(``all_gather_parameters``).  Your base, ``minizero.course.labs.given.ZeRO1``, is the package's ZeRO-1 without them:
wrapping, the flat sharded layout, the full gradient buffers and the hook that keeps every ``.grad`` in them,
``pre_forward`` (it opens an accumulation window, and calls your ``all_gather_parameters`` first when an
optimizer built over ``stage.parameters()`` stepped the shards), the user's optimizer rebuilt over the pieces,
and ``step``: it steps the owned pieces, then calls your ``all_gather_parameters``.  Any part of minizero is
yours to use.

The state the contract speaks of (r = ``self.rank``, N = ``self.world_size``):
  * ``self.groups`` (``minizero.parts.layout.FlatGroup``), one per optimizer param group and dtype, cut at ``bucket_mb``
    (25 MiB unless the checker draws another): ``data``, the full
    flat parameters, padded with zeros to N x ``shard_size`` elements (every parameter is a view into it);
    ``shard``, rank r's owned range ``[r*S, (r+1)*S)`` of it (S = ``shard_size``; a view); ``segments``, where
    each parameter lies (``param``, ``start``, ``stop``); ``pieces``, the part of each parameter inside the owned
    shard -- ``param`` a 1-D Parameter viewing the shard (what the optimizer steps), ``offset`` its start in the
    shard, ``start``/``stop`` its range in the parameter, ``segment`` the parameter's;
  * ``self.full_grads`` (``minizero.parts.grad_buffers.FullGradients``): ``buffers[g]``, group g's full gradient
    buffer, laid out as its ``data``; during backward every parameter's ``.grad`` is a view into it, so it
    holds this rank's gradients summed over the accumulation window.  ``window_open``: a window is open (the
    given ``pre_forward`` opens one at the first forward after a synchronisation: a piece that still holds a
    ``.grad`` then carries it in a tensor of its own, and the owned shard of the buffer starts from zero);
  * ``self._used``: ids of the parameters that got a gradient on this rank since the last synchronisation;
  * ``self.find_unused_parameters``, ``self.comm`` (every collective goes through it: the byte ledger counts
    what it sends; the ranks' collectives pair up in the order they are called), ``self.wire`` (None unless
    compression or a mixed-precision reduce dtype is on: a collective that averages takes it as ``wire=``, with
    ``key=`` naming the buffer);
  * ``self.remember_shared()``: records that the full parameters are current (each group's version): the next
    forward compares the shards with it, and all-gathers again if they changed since.

The checker's properties, in order:
  1. your methods are what runs: both are defined in this file and called during a step;
  2. equivalence to single-device training, parameters and optimizer states after every step, on drawn examples:
     world sizes 1-4, K = 1-3, uneven batches, SGD/momentum/Adam, float64 (<= 1e-9) and float32 (<= 1e-5), two param
     groups, clipping, the edge model, backwards inside and outside no_sync() in every order (their averages add),
     the routed model (a branch used by some ranks' micro-batches only, or by none), the optimizer built after
     wrapping, fp16 with error feedback and one parameter a group (each group's residual its own: ``key=``);
  3. bytes per step: a reduce-scatter of the gradients plus an all-gather of the parameters, 2(N-1)/N x Psi x b --
     exactly DDP's -- as reduce-scatters and all-gathers only (N = 2 and 3); under the fp16 and int8 wires
     (``compress=``) each rank's bytes in each step equal the package's stage's: a collective that averages
     gradients without the stage's ``wire=self.wire`` sends them at full width;
  4. memory: the model state each rank holds after a step (AdamW, N = 4) is 4Psi + 4Psi + 8Psi/N bytes --
     parameters, full gradients, optimizer states for the owned shard only -- no second copy of a gradient.

Check it:   python -m minizero check zero1 --impl THIS_FILE
"""
from __future__ import annotations

from minizero.course.labs.given import ZeRO1 as GivenZeRO1


class ZeRO1(GivenZeRO1):
    def post_backward(self) -> None:
        """Runs once per synchronising backward, on every rank, after the whole backward.  After it, for each
        group g and its buffer ``self.full_grads.buffers[g]``:
          * rank r's shard of the buffer holds the mean over the N ranks of their buffers' shard r -- the
            buffer's own memory (a reduce-scatter: rank r receives only its shard, half an all-reduce);
          * the other ranks' shards of the buffer are zero (they own those averages; what accumulates next is new);
          * each piece whose parameter has a gradient on some rank has as ``.grad`` its range of that averaged
            shard (a view into the buffer), with what the piece carried from before this window added to it
            (torch accumulates into ``.grad``); a piece with neither keeps ``.grad = None`` (not stepped);
        and then: the accumulation window is closed (``self.full_grads.window_open`` False), ``self._used`` is
        empty.  Which parameters have a gradient anywhere, the ranks agree on when ``find_unused_parameters`` is
        set (a parameter may have one on some ranks only); without it every one has one on every rank.
        """
        raise NotImplementedError("write ZeRO1.post_backward: each owned shard of the gradient buffers the mean "
                                  "over ranks, the pieces' .grad")

    # Given, in the base: ``step()`` steps the owned pieces -- unless fp16 overflowed, when nothing changed -- and
    # then calls your ``all_gather_parameters()`` to share them.

    def all_gather_parameters(self) -> None:
        """Called on every rank at once, after the owned shards were stepped.  After it: every group's ``data`` --
        so every parameter -- on every rank is every rank's owned shard, end to end, and the stage has recorded
        that the full parameters are current (``self.remember_shared()``; otherwise the next forward all-gathers
        them again: a third Psi of bytes).  Cost: one all-gather per group, (N-1)/N x Psi x b in all.  (A group no
        rank had a gradient for did not change: the package skips it -- on every rank alike.)
        """
        raise NotImplementedError("write ZeRO1.all_gather_parameters: every rank's stepped shard everywhere")

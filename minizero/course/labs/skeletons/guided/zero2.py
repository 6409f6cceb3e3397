"""Lab 8 -- ZeRO-2's per-bucket reduce-scatter during backward (lessons/08_zero2.ipynb).
Guided level: each method says what to do and which parts exist; the contract level states only what must hold.

Given: buckets that are flat sharded groups of their own (``self.buckets``, last
layer first, each padded to a multiple of N: the owned shards of all buckets
together are this rank's shard), the pipeline (``self.pipeline``) that launches a
complete bucket on the communication thread, the pieces and the step (ZeRO-1's:
step the owned pieces, all-gather).
Yours: ZeRO-2's backward -- ``post_accumulate_grad`` (a gradient is final),
``deferred_reduce_scatter`` (what a complete bucket does) and ``post_backward`` (the end
of backward).

Check it:   python -m minizero check zero2 --impl THIS_FILE
Besides equivalence and bytes, the checker measures the model state each rank
holds after a step against 4Psi + 12Psi/N -- a full gradient that outlives its
bucket shows there -- and watches a backward for overlap.
"""
from __future__ import annotations

from minizero.course.labs.given import ZeRO2 as GivenZeRO2


class ZeRO2(GivenZeRO2):
    def post_accumulate_grad(self, param) -> None:
        """The post-accumulate-grad hook: ``param.grad`` is final for this backward.  Record that it got a
        gradient here (``self._used``, a set of parameter ids) and, if this backward synchronises
        (``self._syncing``; False inside ``no_sync()``, where gradients accumulate in full), tell the pipeline
        it is ready -- the pipeline then launches every bucket that is complete, in order, through your
        ``deferred_reduce_scatter``."""
        raise NotImplementedError("write ZeRO2.post_accumulate_grad: record the gradient, mark it ready")

    def deferred_reduce_scatter(self, index: int):
        """Bucket ``index`` (``self.buckets[index]``) is complete.  Here, on the main thread: pack its gradients
        into a new flat tensor and *free* every full gradient -- the memory ZeRO-2 saves; the bucket has a method
        that does both.  Return a function of no arguments, run later on the communication thread, that
        reduce-scatters the packed gradients, averaged over ranks, into a new tensor the size of the bucket's
        shard and returns it -- through ``self.comm``, over the stage's wire ``self.wire`` with the bucket as
        its ``key``, labelled with a ``self.tag(...)`` taken here, on the main thread.
        """
        raise NotImplementedError("write ZeRO2.deferred_reduce_scatter: take the bucket's gradients (packed, freed), "
                                  "return its reduce-scatter")

    def post_backward(self) -> None:
        """Backward has finished: every bucket's reduce-scatter launched, waited for, and handed to the pieces.

        All of it inside the pipeline's ``round()`` -- one backward's round: whatever happens, nothing is left
        running or marked for the next one:
          1. launch the buckets that never completed (parameters whose gradient came from earlier micro-batches
             only) -- the pipeline can;
          2. find which parameters got a gradient (those the optimizer steps): the base's ``used_anywhere``,
             over every bucket's segments -- after every bucket is launched, so that its bitmap (with
             ``find_unused_parameters``) queues behind them in the same place on every rank;
          3. wait for every bucket's result, in index order (the pipeline again), and give each piece its range
             of its bucket's averaged shard as ``.grad`` -- added to a ``.grad`` it has, as autograd does; the
             base's ``accumulate`` does that for one bucket.
        """
        raise NotImplementedError("write ZeRO2.post_backward: launch the rest, wait for every bucket, give the "
                                  "pieces their averaged gradients")

"""Lab 4 -- buckets launched during backward (lessons/04_bucketing_and_overlap.ipynb).

Contract level: each method states what must hold after it runs and what the checker holds it to -- not how.
(The guided level says which parts of minizero exist for it:
``python -m minizero lab ddp-bucketed FILE --level guided``.)

You write what happens when one parameter's gradient is final (``post_accumulate_grad``) and what a complete
bucket does (``deferred_all_reduce``).  Your base, ``minizero.course.labs.given.BucketedDDP``, is the package's bucketed DDP
without them: wrapping; the buckets; the post-accumulate-grad hook on every trainable parameter, which calls
your ``post_accumulate_grad``; the pipeline, which calls your ``deferred_all_reduce`` for each complete bucket and runs
what it returns; ``post_backward``, which at the end of backward launches the buckets that never completed,
agrees with the other ranks on which parameters got a gradient, and waits for every bucket; ``zero_grad`` (the
buckets zeroed, every ``.grad`` their view again) and ``step``.  Any part of minizero is yours to use.

The state the contract speaks of:
  * ``self.buckets`` (each a ``Bucket``): flat buffers of gradients, last layer first; bucket ``b``'s
    ``buffer`` holds its parameters' gradients end to end, ``views[i]`` is the view of it shaped as its
    ``params[i]``; ``self._slot[id(param)]`` is ``(bucket, i)``;
  * ``self.pipeline`` (``minizero.parts.buckets.BucketPipeline``): it must hear of every parameter whose gradient
    is ready; it launches bucket b -- calls ``deferred_all_reduce(b)`` and submits the result to the communication
    thread -- once b and every bucket before it are complete, so buckets leave in the same order on every rank;
  * ``self._used``: the ids of the parameters that got a gradient on this rank in this backward (the given
    ``post_backward`` reads it, and empties it);
  * ``self._syncing``: whether this backward synchronises (False for a backward inside ``no_sync()``);
  * ``self.comm`` (this rank's Comm: the byte ledger counts what it sends), ``self.wire`` (the wire gradients
    are averaged over, None unless compression or a mixed-precision reduce dtype is on: a collective that
    averages takes it as ``wire=``, with ``key=`` naming the buffer).

The checker's properties, in order:
  1. your methods are what runs: both are defined in this file and called during a step;
  2. equivalence to single-device training, every parameter after every step, on drawn examples: world sizes 1-4, K
     = 1-3 micro-batches (the first K-1 inside no_sync()), uneven batches, SGD/momentum/Adam, float64 (<= 1e-9) and
     float32 (<= 1e-5), bucket caps of one parameter per bucket up to one bucket, the edge model, backwards inside
     and outside no_sync() in every order (their averages add), the routed model (a branch used by some ranks'
     micro-batches only, or by none), the optimizer built after wrapping -- whose ``zero_grad()`` sets every
     ``.grad`` to None behind the stage -- and fp16 with error feedback, one parameter a bucket (each bucket's
     residual its own: ``key=``);
  3. bytes per step: one ring all-reduce of every gradient, 2(N-1)/N x Psi x b, as all-reduces only; under the fp16
     and int8 wires (``compress=``) each rank's bytes in each step equal the package's stage's: a collective that
     averages gradients without the stage's ``wire=self.wire`` sends them at full width;
  4. overlap (N = 2, one parameter per bucket): in every synchronising backward the first bucket's collective
     is submitted to the communication thread while backward still has gradients to compute, and no
     collective runs on the main thread before backward ends.

Check it:   python -m minizero check ddp-bucketed --impl THIS_FILE
"""
from __future__ import annotations

from minizero.course.labs.given import BucketedDDP as GivenBucketedDDP


class BucketedDDP(GivenBucketedDDP):
    def post_accumulate_grad(self, param) -> None:
        """Runs (main thread, during backward) when ``param.grad`` holds this backward's final, accumulated value
        -- called with the *parameter*.  After it:
          * ``param.grad`` is its bucket's view again, holding that value -- a user's ``zero_grad()`` may have set
            ``.grad`` to None, and autograd then put the gradient in a fresh tensor the bucket never sees;
          * ``id(param)`` is in ``self._used``;
          * if this backward synchronises, the pipeline knows ``param`` is ready (inside ``no_sync()`` nothing is
            launched: gradients accumulate in the buckets);
          * no collective ran here, on the main thread.
        """
        raise NotImplementedError("write BucketedDDP.post_accumulate_grad: the gradient in its bucket, recorded, "
                                  "ready")

    def deferred_all_reduce(self, index: int):
        """Called on the main thread when bucket ``index`` is launched; communicates nothing itself.  Returns a
        function of no arguments which, run later on the communication thread (after every bucket launched
        before it), leaves in the bucket's buffer, in place, the mean over the N ranks of their buffers -- over
        ``self.wire`` when there is one, the bucket named as its key.  Its cost: the bucket's share of one
        all-reduce of every gradient per step.
        """
        raise NotImplementedError("write BucketedDDP.deferred_all_reduce: return the bucket's average, to run later")

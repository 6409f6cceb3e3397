"""Lab 8 -- ZeRO-2's per-bucket reduce-scatter during backward (lessons/08_zero2.ipynb).

Contract level: each method states what must hold after it runs and what the checker holds it to -- not how.
(The guided level says which parts of minizero exist for it: ``python -m minizero lab zero2 FILE --level guided``.)

You write ZeRO-2's backward: ``post_accumulate_grad`` (one gradient is final), ``deferred_reduce_scatter`` (what a
complete bucket does) and ``post_backward`` (the end of backward).  Your base, ``minizero.course.labs.given.ZeRO2``, is
the package's ZeRO-2 without them: wrapping, the buckets, the post-accumulate-grad hook on every trainable
parameter (it calls your ``post_accumulate_grad``), the pipeline (it calls your ``deferred_reduce_scatter``), the hook
that calls ``post_backward`` after a synchronising backward, the pieces, and the step: the owned pieces
stepped, then every bucket that had a gradient anywhere all-gathered.  Any part of minizero is yours to use.

The state the contract speaks of (r = ``self.rank``, N = ``self.world_size``):
  * ``self.buckets`` (``minizero.parts.layout.FlatGroup``): each a flat sharded group of its own (``self.groups``), last
    layer first, padded to a multiple of N -- ``shard_size`` S (rank r owns ``[r*S, (r+1)*S)`` of the bucket),
    ``shard`` (the owned range of the parameters), ``segments`` (where each parameter lies: ``param``,
    ``start``, ``stop``), ``pieces`` (the part of each parameter in the owned shard: ``param`` a 1-D Parameter,
    what the optimizer steps; ``offset`` its start in the shard; ``start``/``stop`` its range in the parameter;
    ``segment``).  The owned shards of all buckets together are this rank's 1/N of the model;
  * ``self.pipeline`` (``minizero.parts.buckets.BucketPipeline``): it must hear of every parameter whose gradient is
    ready in a synchronising backward; it launches bucket b -- calls ``deferred_reduce_scatter(b)`` on the main thread
    and submits what that returns to the communication thread -- once b and every bucket before it are
    complete, so buckets leave in the same order on every rank; it keeps what it launched until collected,
    and what it heard until reset;
  * ``self._used``: ids of the parameters that got a gradient on this rank in this window;
    ``self._has_grad``: ids of the parameters with a gradient on some rank since the last ``zero_grad()`` --
    the given step all-gathers only the buckets holding one;
  * ``self._syncing``: whether this backward synchronises (False inside ``no_sync()``, where full gradients
    accumulate in ``.grad`` until the last micro-batch);
  * ``self.find_unused_parameters``, ``self.comm`` (every collective goes through it: the byte ledger counts
    what it sends; the ranks' collectives pair up in the order they are called), ``self.wire`` (None unless
    compression or a mixed-precision reduce dtype is on: a collective that averages takes it as ``wire=``,
    with ``key=`` naming the buffer).

The checker's properties, in order:
  1. your methods are what runs: all three are defined in this file and called during a step;
  2. equivalence to single-device training, parameters and optimizer states after every step, on drawn examples:
     world sizes 1-4, K = 1-3 (the first K-1 inside no_sync()), uneven batches, SGD/momentum/Adam, float64 (<= 1e-9)
     and float32 (<= 1e-5), bucket caps from one parameter per bucket to one bucket, two param groups, clipping, the
     edge model, backwards inside and outside no_sync() in every order (their averages add), the routed model (a
     branch used by some ranks' micro-batches only, or by none), the optimizer built after wrapping, a bucket's
     collective failing on every rank (the error caught, the step run again), fp16 with error feedback and one
     parameter a bucket (each bucket's residual its own: ``key=``);
  3. bytes per step: reduce-scatters of the gradients plus all-gathers of the parameters, 2(N-1)/N x Psi x b, as
     reduce-scatters and all-gathers only (N = 2 and 3); under the fp16 and int8 wires (``compress=``) each rank's
     bytes in each step equal the package's stage's: a collective that averages gradients without the stage's
     ``wire=self.wire`` sends them at full width;
  4. memory: the model state each rank holds after a step (AdamW, N = 4) is 4Psi + 12Psi/N bytes -- a full
     gradient that outlives its bucket's launch shows there;
  5. overlap (N = 2, one parameter per bucket): the first bucket's collective is submitted to the communication
     thread while backward still has gradients to compute, and no collective runs on the main thread before
     backward ends.

Check it:   python -m minizero check zero2 --impl THIS_FILE
"""
from __future__ import annotations

from minizero.course.labs.given import ZeRO2 as GivenZeRO2


class ZeRO2(GivenZeRO2):
    def post_accumulate_grad(self, param) -> None:
        """Runs (main thread, during backward) when ``param.grad`` holds this backward's final value -- called
        with the *parameter*.  After it: ``id(param)`` is in ``self._used``; if this backward synchronises, the
        pipeline knows ``param`` is ready; no collective ran here."""
        raise NotImplementedError("write ZeRO2.post_accumulate_grad: the gradient recorded, and ready")

    def deferred_reduce_scatter(self, index: int):
        """Called on the main thread when bucket ``index`` is launched; communicates nothing itself.  After it no
        parameter of the bucket holds a full ``.grad`` any more (None: the memory ZeRO-2 saves), their values
        kept, flat, in the bucket's layout (zeros for padding and for a parameter without one).  Returns a
        function of no arguments which, run later on the communication thread, returns a new tensor of
        ``shard_size`` elements: rank r's shard of the mean over the N ranks of those flat gradients -- over
        ``self.wire`` when there is one, the bucket named as its key -- the bucket's share of one reduce-scatter
        of every gradient per step.
        """
        raise NotImplementedError("write ZeRO2.deferred_reduce_scatter: the bucket's gradients taken (freed), its "
                                  "reduce-scatter returned, to run later")

    def post_backward(self) -> None:
        """Runs once per synchronising backward, on every rank, after the whole backward.  After it:
          * every bucket was launched -- those that never completed too (parameters whose gradient came only
            from micro-batches inside ``no_sync()``, or none) -- and every launched bucket's result collected;
          * each piece whose parameter has a gradient on some rank has its range of its bucket's averaged shard
            as ``.grad`` -- added to the ``.grad`` it had, as autograd accumulates; a piece of a parameter with a
            gradient nowhere keeps its ``.grad`` (None after a ``zero_grad()``: not stepped);
          * those parameters' ids are in ``self._has_grad``; ``self._used`` is empty; the pipeline has nothing
            running and nothing marked -- also when something here raised -- ready for the next backward.
        Which parameters have a gradient anywhere, the ranks agree on when ``find_unused_parameters`` is set --
        with a collective issued after every bucket's, so it pairs with the same call on every rank.
        """
        raise NotImplementedError("write ZeRO2.post_backward: every bucket launched and collected, the pieces' "
                                  ".grad their averaged range")

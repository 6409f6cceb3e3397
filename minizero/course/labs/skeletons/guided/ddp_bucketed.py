"""Lab 4 -- buckets launched during backward (lessons/04_bucketing_and_overlap.ipynb).
Guided level: each method says what to do and which parts exist; the contract level states only what must hold.

Given: the buckets (``self.buckets``: flat buffers filled last layer first, each
``.grad`` a view into its bucket), the pipeline (``self.pipeline``) that launches
complete buckets in index order on the communication thread, and
``post_backward``, which at the end of backward launches what is left and waits
for every bucket.
Yours: ``post_accumulate_grad`` -- what happens when one parameter's gradient is
final -- and ``deferred_all_reduce``, what a launched bucket does.

Check it:   python -m minizero check ddp-bucketed --impl THIS_FILE
Besides equivalence and bytes, the checker watches a backward: the first bucket's
all-reduce must leave while backward still has gradients to compute (overlap).
"""
from __future__ import annotations

from minizero.course.labs.given import BucketedDDP as GivenBucketedDDP


class BucketedDDP(GivenBucketedDDP):
    def post_accumulate_grad(self, param) -> None:
        """The post-accumulate-grad hook (``param.register_post_accumulate_grad_hook``): ``param.grad`` now holds
        this backward's final, accumulated value.

        (Not a tensor hook on ``param``: that fires *before* accumulation, and syncing there averages the last
        micro-batch only.  And the hook receives the *parameter*: it is ``param.grad`` that gets reduced.)
        Three things:
          1. the gradient must live in its bucket: a user's ``optimizer.zero_grad()`` may have set ``.grad`` to
             None, and autograd then made a fresh tensor -- put its value back into the bucket's view and make
             that view ``.grad`` again (``self._slot`` maps a parameter's id to its bucket and position;
             ``minizero.parts.flat`` has a function for exactly this);
          2. record that it got a gradient here: ``self._used``, a set of parameter ids, which the given
             ``post_backward`` reads;
          3. if this backward synchronises (``self._syncing``; False inside ``no_sync()``), tell the pipeline
             the parameter is ready -- it launches every bucket that is now complete, in order.
        """
        raise NotImplementedError("write BucketedDDP.post_accumulate_grad: keep the gradient in its bucket, "
                                  "record it, mark it ready")

    def deferred_all_reduce(self, index: int):
        """Bucket ``index`` is complete: return a function of no arguments that averages it in place.

        The pipeline runs what you return on the communication thread while backward goes on -- so do no
        communication here, only in the returned function.  It averages the bucket's flat buffer over the ranks
        through ``self.comm``, over the stage's wire ``self.wire`` (with the bucket as its ``key``), labelled
        with ``self.tag(...)`` -- take the tag here, on the main thread: it records where training is now.
        """
        raise NotImplementedError("write BucketedDDP.deferred_all_reduce: return the bucket's all-reduce, to run later")

"""Lab 3 -- buckets launched during backward (lessons/03_bucketing_and_overlap.ipynb).

Given: the buckets (``self.buckets``: flat buffers filled last layer first, each
``.grad`` a view into its bucket), the pipeline (``self.pipeline``) that launches
complete buckets in index order on the communication thread, and
``post_backward``, which at the end of backward launches what is left and waits
for every bucket.
Yours: ``post_accumulate_grad`` -- what happens when one parameter's gradient is
final -- and ``_all_reduce``, what a launched bucket does.

Check it:   python -m minizero check ddp-bucketed --impl THIS_FILE
Besides equivalence and bytes, the checker watches a backward: the first bucket's
all-reduce must leave while backward still has gradients to compute (overlap).
"""
from __future__ import annotations

from minizero.labs.given import BucketedDDP as GivenBucketedDDP


class BucketedDDP(GivenBucketedDDP):
    def post_accumulate_grad(self, param) -> None:
        """The post-accumulate-grad hook (``param.register_post_accumulate_grad_hook``): ``param.grad`` now holds
        this backward's final, accumulated value.

        (Not a tensor hook on ``param``: that fires *before* accumulation, and syncing there averages the last
        micro-batch only.  And the hook receives the *parameter*: it is ``param.grad`` that gets reduced.)
        Do three things:
          1. keep the gradient in its bucket: ``bucket, i = self._slot[id(param)]``, then
             ``minizero.flat.keep_grad_in(param, bucket.views[i])`` (a user's ``zero_grad`` may have replaced it);
          2. record that it has a gradient: ``self._used.add(id(param))``;
          3. if this backward synchronises (``self._syncing``; False inside ``no_sync()``), tell the pipeline:
             ``self.pipeline.mark(param)`` -- it launches every bucket that is now complete, in order.
        """
        raise NotImplementedError("write BucketedDDP.post_accumulate_grad: keep the gradient in its bucket, "
                                  "record it, mark it ready")

    def _all_reduce(self, index: int):
        """Bucket ``index`` is complete: return a function of no arguments that averages it in place.

        The pipeline runs what you return on the communication thread while backward goes on -- so do no
        communication here, only in the returned function.  With ``bucket = self.buckets[index]`` and
        ``tag = self.tag(f"bucket {index}")``, the function calls
        ``self.comm.all_reduce(bucket.buffer, ReduceOp.AVG, tag=tag, wire=self.wire, key=index)``
        (``minizero.comm.ReduceOp``): the mean over ranks, over the 16-bit wire when compression is on
        (``key``: the bucket, for the wire's error feedback).
        """
        raise NotImplementedError("write BucketedDDP._all_reduce: return the bucket's all-reduce, to run later")

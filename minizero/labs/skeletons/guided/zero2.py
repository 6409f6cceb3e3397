"""Lab 6 -- ZeRO-2's per-bucket reduce-scatter during backward (lessons/06_zero2.ipynb).

Given: buckets that are flat sharded groups of their own (``self.groups``, last
layer first, each padded to a multiple of N: the owned shards of all buckets
together are this rank's shard), the pipeline (``self.pipeline``) that launches a
complete bucket on the communication thread, the pieces and the step (ZeRO-1's:
step the owned pieces, all-gather).
Yours: ZeRO-2's backward -- ``post_accumulate_grad`` (a gradient is final),
``_reduce_scatter`` (what a complete bucket does) and ``post_backward`` (the end
of backward).

Check it:   python -m minizero check zero2 --impl THIS_FILE
Besides equivalence and bytes, the checker measures the model state each rank
holds after a step against 4Psi + 12Psi/N -- a full gradient that outlives its
bucket shows there -- and watches a backward for overlap.
"""
from __future__ import annotations

from minizero.labs.given import ZeRO2 as GivenZeRO2


class ZeRO2(GivenZeRO2):
    def post_accumulate_grad(self, param) -> None:
        """The post-accumulate-grad hook: ``param.grad`` is final for this backward.
        Record it (``self._used.add(id(param))``) and, if this backward synchronises (``self._syncing``; False
        inside ``no_sync()``, where gradients accumulate in full), mark it ready: ``self.pipeline.mark(param)``
        -- the pipeline then launches every bucket that is complete, in order, through your ``_reduce_scatter``."""
        raise NotImplementedError("write ZeRO2.post_accumulate_grad: record the gradient, mark it ready")

    def _reduce_scatter(self, index: int):
        """Bucket ``index`` is complete.  Here, on the main thread: pack its gradients into a new flat tensor and
        *free* every full gradient -- the memory ZeRO-2 saves: ``full = group.take_gradients()`` with
        ``group = self.groups[index]``.  Return a function of no arguments, run later on the communication
        thread, that reduce-scatters ``full`` into a new shard-sized tensor
        ``averaged = torch.empty_like(group.shard)`` with
        ``self.comm.reduce_scatter(averaged, full, ReduceOp.AVG, tag=tag, wire=self.wire, key=index)``
        (``tag = self.tag(f"bucket {index}")``, taken here; ``minizero.comm.ReduceOp``) and returns ``averaged``.
        """
        raise NotImplementedError("write ZeRO2._reduce_scatter: take the bucket's gradients (packed, freed), "
                                  "return its reduce-scatter")

    def post_backward(self) -> None:
        """Backward has finished: every bucket's reduce-scatter launched, waited for, and handed to the pieces.

        All of it inside ``with self.pipeline.round():`` -- one backward's round: whatever happens, nothing is
        left running or marked for the next one:
          1. ``self.pipeline.launch_rest()``: launch the buckets that never completed (parameters whose gradient
             came from earlier micro-batches only);
          2. ``used = self.used_anywhere([s.param for group in self.groups for s in group.segments])``: which
             parameters got a gradient (those the optimizer steps);
          3. ``for index, averaged in self.pipeline.wait_all():`` -- every bucket's result, in index order --
             ``self.accumulate(self.groups[index], averaged, used)`` gives each piece its range of ``averaged`` as
             ``.grad`` (added to a ``.grad`` it has, as autograd does).
        (The package's answer first names a parameter without a gradient on this rank,
        ``self.refuse_unused_here(self.groups)``; the training loop the checker runs never leaves one out.)
        """
        raise NotImplementedError("write ZeRO2.post_backward: launch the rest, wait for every bucket, give the "
                                  "pieces their averaged gradients")

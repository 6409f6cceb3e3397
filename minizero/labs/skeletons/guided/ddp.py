"""Lab 2 -- DDP's gradient synchronisation (lessons/02_ddp_allreduce.ipynb).

Given: wrapping (rank 0's parameters broadcast to all), the hook that calls
``post_backward`` once the whole backward has finished, ``no_sync()``, and
``step`` (the user's optimizer, identically on every rank).
Yours: ``post_backward`` -- the one idea of DDP.

Check it:   python -m minizero check ddp --impl THIS_FILE
The checker trains your stage and single-device training side by side on drawn
examples (world sizes 1-4, uneven batches, K micro-batches, SGD/Adam, float64
and float32), compares every parameter after every step, and counts your bytes
against the ring all-reduce's 2(N-1)/N x Psi x b per step.
"""
from __future__ import annotations

from minizero.labs.given import DDP as GivenDDP


class DDP(GivenDDP):
    def post_backward(self) -> None:
        """Backward has finished on every rank: make every ``.grad`` the *average* over ranks.

        After this, every rank holds the same gradients, equal to the gradient of the mean loss over the
        global batch -- so the same optimizer step keeps the replicas equal, and equal to one device.
        Send few, large messages: pack the gradients into one flat buffer per dtype, all-reduce it as an
        average, and unpack.

        You may use:
          * ``self._with_gradient()``: the parameters to synchronise, the same list on every rank;
          * ``minizero.flat``: ``group_by_dtype(tensors)`` -> {dtype: [tensors]}, ``pack(tensors)`` -> a flat copy,
            ``unpack(flat, tensors)`` copies back;
          * ``self.comm.all_reduce(flat, ReduceOp.AVG, tag=self.tag(f"gradients ({dtype})"), wire=self.wire,
            key=dtype)`` (``minizero.comm.ReduceOp``): in place, the sum over ranks divided by N -- ``ReduceOp.SUM``
            would leave the sum, N times the gradient.  ``wire`` is compression's (lab 4: None here, the plain
            average); ``key`` names the buffer for it.
        """
        raise NotImplementedError("write DDP.post_backward: average the gradients over ranks (an all-reduce with "
                                  "ReduceOp.AVG, one flat buffer per dtype)")

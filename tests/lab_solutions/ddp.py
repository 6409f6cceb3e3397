"""A filled-in skeleton, written from its docstrings alone (tests/test_labs.py checks it passes).

Lab 2 -- DDP's gradient synchronisation (lessons/02_ddp_allreduce.ipynb).

Given: wrapping (rank 0's parameters broadcast to all), the hook that calls
``sync_gradients`` once backward has finished, ``no_sync()``, the optimizer step.
Yours: ``sync_gradients`` -- the one idea of DDP.

Check it:   python -m minizero check ddp --impl THIS_FILE
The checker trains your stage and single-device training side by side on drawn
examples (world sizes 1-4, uneven batches, K micro-batches, SGD/Adam, float64
and float32), compares every parameter after every step, and counts your bytes
against the ring all-reduce's 2(N-1)/N x Psi x b per step.
"""
from __future__ import annotations

from minizero.stages import DDP as GivenDDP


class DDP(GivenDDP):
    def sync_gradients(self) -> None:
        """Backward has finished on every rank: make every ``.grad`` the *average* over ranks.

        After this, every rank holds the same gradients, equal to the gradient of the mean loss over the
        global batch -- so the same optimizer step keeps the replicas equal, and equal to one device.
        Send few, large messages: pack the gradients into one flat buffer (per dtype), all-reduce it, divide,
        and unpack.

        You may use:
          * ``self._with_gradient()``: the parameters to synchronise, the same list on every rank;
          * ``minizero.flat``: ``group_by_dtype(tensors)`` -> {dtype: [tensors]}, ``pack(tensors)`` -> a flat copy,
            ``unpack(flat, tensors)`` copies back;
          * ``self.comm.all_reduce(flat, ReduceOp.SUM, tag=self.tag("gradients"))`` (``minizero.comm.ReduceOp``);
          * ``self.world_size`` (N).
        """
        from minizero.comm import ReduceOp
        from minizero.flat import group_by_dtype, pack, unpack
        for dtype, grads in group_by_dtype([p.grad for p in self._with_gradient()]).items():
            flat = pack(grads)
            self.comm.all_reduce(flat, ReduceOp.SUM, tag=self.tag("gradients"))
            flat.div_(self.world_size)
            unpack(flat, grads)

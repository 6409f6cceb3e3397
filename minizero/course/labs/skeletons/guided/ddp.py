"""Lab 3 -- DDP's gradient synchronisation (lessons/03_ddp_allreduce.ipynb).
Guided level: the method says what to do and which parts exist; the contract level states only what must hold.

Given: wrapping (rank 0's parameters broadcast to all), the hook that calls
``post_backward`` once the whole backward has finished, ``no_sync()``, and
``step`` (the user's optimizer, identically on every rank).
Yours: ``post_backward`` -- the one idea of DDP.

Check it:   python -m minizero check ddp --impl THIS_FILE
The checker trains your stage and single-device training side by side on drawn
examples (world sizes 1-4, uneven batches, K micro-batches, SGD/Adam, float64
and float32, the edge model with frozen and unused parameters), compares every
parameter after every step, and counts your bytes against the ring all-reduce's
2(N-1)/N x Psi x b per step.
"""
from __future__ import annotations

from minizero.course.labs.given import DDP as GivenDDP


class DDP(GivenDDP):
    def post_backward(self) -> None:
        """Backward has finished on every rank: make every ``.grad`` the *average* over ranks.

        After this, every rank holds the same gradients, equal to the gradient of the mean loss over the
        global batch -- so the same optimizer step keeps the replicas equal, and equal to one device.
        Send few, large messages: pack the gradients into one flat buffer per dtype, all-reduce each buffer
        as an average (not a sum: that is N times the gradient), and copy the result back into the ``.grad``s.
        Every rank must put the same parameters in the same order into its buffers.

        The parts you have:
          * ``self._with_gradient()``: the parameters to synchronise, the same list on every rank (with
            ``find_unused_parameters`` the ranks agree on it first);
          * ``minizero.parts.flat``: grouping tensors by dtype, packing them into a flat copy, unpacking it back;
          * ``self.comm``: the collectives (``minizero.comm.ReduceOp`` names the reduction); an average takes
            the stage's wire, ``self.wire`` (None unless compression or mixed precision's reduce dtype is on),
            with a ``key`` naming the buffer; ``self.tag(what)`` labels a collective for the fingerprint check.
        """
        raise NotImplementedError("write DDP.post_backward: average the gradients over ranks (one flat all-reduce "
                                  "per dtype)")

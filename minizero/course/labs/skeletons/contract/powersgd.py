"""Lab 16 -- the PowerSGD step (lessons/16_when_compression_pays.ipynb).

Contract level: the method states what must hold after it runs and what the checker holds it to -- not how.
(The guided level says which parts of minizero exist for it: ``python -m minizero lab powersgd FILE --level guided``.)

You write ``PowerSGDWire.power_step``: one rank's share of averaging one gradient buffer as low-rank factors
(Vogels et al. 2019, Algorithm 1; torch's ``powerSGD_hook``).  Your base, ``minizero.course.labs.given``'s
``PowerSGDWire``, is the package's wire without it: it adds the error-feedback residual to the buffer, cuts the
buffer into its tensors (``plan``), hands you the Q to start from (random or last step's, already orthonormal),
and keeps the residual and the Q you return.  The stage is the package's ddp-bucketed; it builds its PowerSGD
wire from its ``wire_class``: keep that your ``PowerSGDWire``.

The state the contract speaks of:
  * ``plan`` (``minizero.compress.powersgd_layout.Layout``): ``plan.rest``, the (offset, numel) of each tensor sent
    uncompressed; ``plan.matrices``, each compressed tensor as a ``Matrix`` -- its ``offset`` in the buffer, its
    shape ``n`` x ``m`` (row-major, as ``buffer[offset:offset + n*m].view(n, m)``), its rank ``r``, and where its
    P (n x r) and Q (m x r) lie in the flat P and Q buffers (``p_offset``, ``q_offset``; ``plan.p_size``,
    ``plan.q_size`` long);
  * ``q``: the flat Q buffer to start from (each matrix's m x r block orthonormal);
  * ``self.comm`` (this rank's Comm; ``self.comm.world_size`` is N), ``self.settings.epsilon`` (added to a norm
    before dividing by it; 0: a zero column is an error), ``tag`` (label each collective with it).

The checker's properties, in order:
  1. your method is what runs: defined in this file and called in a step (compress="powersgd:rank=2");
  2. equivalence to a reference taking the same PowerSGD steps on the same per-rank buffers, with its sums in
     the ring's order (so sum with ``self.comm.all_reduce``, in place, ``ReduceOp.SUM``): world sizes 1-4, K = 1-3,
     uneven batches, the edge model and the GPT, rank 1-3, warm start on and off, error feedback on and off -- and
     whatever is drawn, rank 3 (QR) and epsilon = 0.25;
  3. bytes: the ring carries per step exactly three all-reduces -- the uncompressed tensors, every P (n r per
     matrix), every Q (m r per matrix) -- at N = 2 and 3 (an empty one is not sent).

Check it:   python -m minizero check powersgd --impl THIS_FILE
"""
from __future__ import annotations

import torch

from minizero.course.labs.given import PowerSGDBucketedDDP as GivenBucketedDDP
from minizero.course.labs.given import PowerSGDWire as GivenWire


class PowerSGDWire(GivenWire):
    def power_step(self, carried: torch.Tensor, plan, q: torch.Tensor, tag) -> tuple[torch.Tensor, torch.Tensor]:
        """``carried``: this rank's flat buffer (gradient plus residual), left as it is.  Returns ``(out, new_q)``,
        identical on every rank: ``out`` a new flat buffer where each uncompressed tensor holds the mean over ranks
        of that tensor, and each matrix holds P Q^T with
          * P: the sum over ranks of (that rank's matrix) x (its m x r block of ``q``), then its r columns made
            orthonormal -- for r <= 2 by Gram-Schmidt in column order (each column divided by its 2-norm, plus
            epsilon if that is > 0, then removed from the later columns), for r > 2 by ``torch.linalg.qr``'s Q --
            the reference does exactly these operations, in this order;
          * Q: the sum over ranks of (that rank's matrix)^T x P, divided by N;
        and ``new_q`` the flat Q buffer of those Qs.  Communication: three all-reduces at most, in this order -- the
        uncompressed tensors packed end to end in buffer order, all the Ps (flat P buffer), all the Qs."""
        raise NotImplementedError("write PowerSGDWire.power_step: P = M Q summed, orthonormal; Q = M^T P averaged")


class BucketedDDP(GivenBucketedDDP):
    wire_class = PowerSGDWire  # the stage builds its PowerSGD wire from this class: yours

"""Lab 16 -- the PowerSGD step (lessons/16_when_compression_pays.ipynb).
Guided level: the method says what to do and which parts exist; the contract level states only what must hold.

Given: the package's ddp-bucketed stage and the PowerSGD wire around your step -- it adds the error-feedback
residual to the buffer (``carried``), cuts the buffer into its tensors (``plan``), hands you the Q to start from
(``q``: random, or last step's, already orthonormal), and afterwards keeps your Q and the residual
``carried - out``.  ``minizero.compress.powersgd_layout`` has the pieces: ``rest_of(buffer, plan)`` (the uncompressed
tensors packed), ``project(buffer, plan, q)`` (a flat P: M Q for every matrix), ``back_project(buffer, plan, p)``
(a flat Q: M^T P), ``orthogonalize(columns, epsilon, what)`` (in place), and the views ``matrix(buffer, mx)``,
``p_of(p, mx)``, ``q_of(q, mx)`` for one ``mx`` of ``plan.matrices``.
Yours: ``PowerSGDWire.power_step``.

Check it:   python -m minizero check powersgd --impl THIS_FILE
The checker trains with PowerSGD (rank 1-3, warm start on and off, error feedback on and off) at world sizes
1-4 against a reference that takes the same steps on every rank's buffer, then counts the bytes on the ring.
"""
from __future__ import annotations

import torch

from minizero.course.labs.given import PowerSGDBucketedDDP as GivenBucketedDDP
from minizero.course.labs.given import PowerSGDWire as GivenWire


class PowerSGDWire(GivenWire):
    def power_step(self, carried: torch.Tensor, plan, q: torch.Tensor, tag) -> tuple[torch.Tensor, torch.Tensor]:
        """Average ``carried`` over the ranks as low-rank factors; return ``(out, new_q)``.

        1. ``out = torch.empty_like(carried)``.  The uncompressed tensors: ``rest_of(carried, plan)``, summed over
           the ranks by the comm's all-reduce (``ReduceOp.SUM``, in place, labelled with ``tag``; skip it when
           empty), divided by N (``self.comm.world_size``), written back at each ``(offset, numel)`` of ``plan.rest``.
        2. No matrices (``plan.matrices`` empty)?  Return ``out, q``.
        3. ``p = project(carried, plan, q)``; all-reduce it (a sum: no division -- the next step normalizes);
           ``orthogonalize(p_of(p, mx), self.settings.epsilon, ...)`` for each ``mx`` of ``plan.matrices``.
        4. ``new_q = back_project(carried, plan, p)``; all-reduce it, then divide it by N.
        5. Each matrix of ``out``: ``matrix(out, mx)`` = ``p_of(p, mx) @ q_of(new_q, mx).T``.
        """
        raise NotImplementedError("write PowerSGDWire.power_step: the rest averaged; P summed and orthogonalized; "
                                  "Q averaged; M = P Q^T")


class BucketedDDP(GivenBucketedDDP):
    wire_class = PowerSGDWire  # the stage builds its PowerSGD wire from this class: yours

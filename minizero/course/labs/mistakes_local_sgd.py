"""Known mistakes of the local-SGD lab: local SGD with one classic slip each.

As in :mod:`minizero.course.labs.mistakes`: each is a stage with a ``mistake`` sentence
(second person) and a ``name`` under which the checker runs it beside a
learner's failing case, to name the slip when the numbers agree.  They join the
labs' registry (:data:`~minizero.course.labs.mistakes.LAB_MISTAKES`) here, never the
package's.
"""
from __future__ import annotations

import torch

from ...comm import ReduceOp
from ...parts.flat import group_by_dtype, pack, unpack
from ...stages import LocalSGD, registry
from .mistakes import LAB_MISTAKES


class SumsParameters(LocalSGD):
    """All-reduces the parameters with SUM: every replica becomes N times the mean."""

    mistake = "you summed the replicas' parameters instead of averaging them: after each average they were N times too large"
    name = "local-sgd-sums-parameters"

    @torch.no_grad()
    def average(self) -> None:
        params = [p for _, p in self.trainable()]
        for group in group_by_dtype(params).values():
            flat = pack([p.detach() for p in group])
            self.comm.all_reduce(flat, ReduceOp.SUM, tag=self.tag("parameters, averaged"))
            unpack(flat, group)
        if self.outer is not None:
            for anchor, p in zip(self.anchor, params, strict=True):
                anchor.grad = anchor.detach() - p
            self.outer.step()
            for anchor, p in zip(self.anchor, params, strict=True):
                p.copy_(anchor)


class ReversedOuterGradient(LocalSGD):
    """DiLoCo with the outer gradient mean - anchor: the outer step moves away from where the ranks went."""

    mistake = ("your outer gradient had the wrong sign (mean - anchor instead of anchor - mean): DiLoCo's outer step "
               "moved the anchor away from the ranks' average")
    name = "local-sgd-reversed-outer-gradient"

    @torch.no_grad()
    def average(self) -> None:
        params = [p for _, p in self.trainable()]
        for group in group_by_dtype(params).values():
            flat = pack([p.detach() for p in group])
            self.comm.all_reduce(flat, ReduceOp.AVG, tag=self.tag("parameters, averaged"))
            unpack(flat, group)
        if self.outer is not None:
            for anchor, p in zip(self.anchor, params, strict=True):
                anchor.grad = p.detach() - anchor
            self.outer.step()
            for anchor, p in zip(self.anchor, params, strict=True):
                p.copy_(anchor)


MISTAKES = (SumsParameters, ReversedOuterGradient)
LAB_MISTAKES.update(registry(*MISTAKES))

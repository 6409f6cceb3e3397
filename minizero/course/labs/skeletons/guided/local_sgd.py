"""Lab local-sgd -- local SGD and DiLoCo's outer step (lessons/13_parameter_server_async_local_sgd.ipynb).
Guided level: each method says what to do and which parts exist; the contract level states only what must hold.

Given: the stage (``minizero.course.labs.given.LocalSGD``: the package's, wrapped and broadcast, nothing done after
backward -- each rank steps on its own gradient), ``self.average_every`` (H), ``self.steps_taken``,
``self.stepping()`` and ``self.optimizer_step()`` (every stage's step is ``with self.stepping():
self.optimizer_step()``), ``self.trainable()``, ``self.comm`` and ``self.tag``, and -- DiLoCo, when the stage
was given ``outer_lr`` -- ``self.outer`` (torch SGD with Nesterov momentum) over ``self.anchor`` (one tensor per
trainable parameter: the parameters after the last average).  ``minizero.parts.flat``'s ``group_by_dtype``, ``pack``
and ``unpack`` lay tensors end to end and back.
Yours: when to average (``step``) and the average itself (``average``).

Check it:   python -m minizero check local-sgd --impl THIS_FILE
The checker compares H = 1 with plain SGD to single-device training, then every rank, every step, with the
package's local SGD (plain and DiLoCo), and counts one parameter all-reduce every H steps.
"""
from __future__ import annotations

import torch

from minizero.comm import ReduceOp  # noqa: F401 -- for your average
from minizero.course.labs.given import LocalSGD as GivenLocalSGD
from minizero.parts.flat import group_by_dtype, pack, unpack  # noqa: F401 -- for your average


class LocalSGD(GivenLocalSGD):
    def step(self) -> None:
        """Inside ``with self.stepping():`` take this rank's own optimizer step, then, if this is step number H,
        2H, 3H, ... counted from 1 -- ``self.steps_taken`` is still the number of steps *before* this one --
        average.  (Averaging before the local step, or at steps 1, H + 1, ..., is another algorithm.)"""
        raise NotImplementedError("write LocalSGD.step: step this rank's optimizer; every H-th step, average")

    @torch.no_grad()
    def average(self) -> None:
        """1. The trainable parameters, packed into one flat buffer per dtype, all-reduced with ``ReduceOp.AVG``
           (tag it, say ``self.tag("parameters, averaged")``), unpacked back into the parameters: the mean.
        2. With ``self.outer`` (DiLoCo): give each anchor the gradient anchor - mean (the averaged change since the
           last average, reversed: a descent direction for the outer optimizer), ``self.outer.step()``, then copy
           each stepped anchor into its parameter.  With outer lr 1 and no momentum that is the mean again."""
        raise NotImplementedError("write LocalSGD.average: the mean over ranks (DiLoCo: the outer step)")

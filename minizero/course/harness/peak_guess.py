"""Lesson 18's exercise: predict a step's peak, then measure it -- the learner's number judged against the measurement.

A prediction is judged as a lab is: it must be a number of bytes, within a stated share of what the allocator saw;
when it is not, the verdict says which way it is off and, where the number matches a part of the step alone (the
model states, the activations, the two without the moment's own), which part was left out -- or that it reads as
megabytes.  The parts are the package's own prediction (:func:`minizero.course.harness.step_memory.step_bytes`),
so the hint names what the learner's sum is missing, never the answer itself.
"""
from __future__ import annotations

import math

#: How close a prediction must come to the measured peak: the package's own is within 1% for ZeRO-2 (lesson 18), and
#: the model states and activations without the moment's own come 6% under it -- a slip this share must catch.
WITHIN = 0.05


def _is_near(value: float, target: float, share: float) -> bool:
    return target > 0 and abs(value / target - 1) <= share


def judge_peak(predicted, parts: dict, measured: float, within: float = WITHIN) -> tuple[bool, str]:
    """``(passed, verdict)`` for ``predicted``, the learner's bytes per rank at the step's peak, against ``measured``;
    ``parts``: the step's prediction by part (``model_states``, ``activations``, ``total``)."""
    if predicted is None:
        return False, ("write your prediction first: the bytes one rank holds at the step's peak -- the model states "
                       "it keeps, the activations backward needs, and what the moment it peaks at adds")
    try:
        value = float(predicted)
    except (TypeError, ValueError):
        return False, f"a peak is a number of bytes: got {predicted!r}"
    if not math.isfinite(value) or value <= 0:
        return False, f"a peak is a positive, finite number of bytes: got {predicted!r}"
    off = value / measured - 1
    said = f"{value:,.0f} B against the measured {measured:,.0f} B ({off:+.1%})"
    if abs(off) <= within:
        return True, f"{said}: within {within:.0%}"
    way = "too small" if off < 0 else "too large"
    states, activations = parts["model_states"], parts["activations"]
    hints = ((states, "the model states alone: the activations backward keeps come on top"),
             (activations, "the activations alone: the model states the stage keeps come on top"),
             (states + activations, "the model states and the activations, nothing of the moment the step peaks at "
                                    "(a bucket packed beside its gradients, a unit gathered, the step's gradients)"))
    hint = next((f" -- it is {what}" for target, what in hints if _is_near(value, target, within / 2)), "")
    if not hint and any(_is_near(value * unit, measured, within) for unit in (1e6, 2 ** 20)):
        hint = " -- it reads as megabytes: give bytes"
    return False, f"{said}: {way}{hint}"

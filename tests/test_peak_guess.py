"""Lesson 18's exercise judges a predicted peak as a lab judges a file: the blank fails saying what to write, a wrong
number says which way and what part it left out, a right one passes -- each verdict seen here."""
from __future__ import annotations

import math

import pytest

from minizero.course.harness.peak_guess import WITHIN, judge_peak

PARTS = {"model_states": 4_000_000.0, "activations": 5_000_000.0, "total": 10_500_000.0}
MEASURED = 10_400_000.0


@pytest.mark.parametrize("predicted, words", [
    (None, "write your prediction first"),
    ("ten megabytes", "a peak is a number of bytes: got 'ten megabytes'"),
    (math.nan, "positive, finite"), (-5.0, "positive, finite"), (math.inf, "positive, finite"),
    (4_000_000, "too small -- it is the model states alone: the activations backward keeps come on top"),
    (5_100_000, "too small -- it is the activations alone: the model states the stage keeps come on top"),
    (9_000_000, "too small -- it is the model states and the activations, nothing of the moment"),
    (9_750_000, "too small"),  # 6% under: what lesson 18's model states and activations alone came to
    (10.4, "too small -- it reads as megabytes: give bytes"),
    (30_000_000, "too large"),
])
def test_a_wrong_or_missing_prediction_fails_saying_what_is_wrong(predicted, words):
    ok, verdict = judge_peak(predicted, PARTS, MEASURED)
    assert not ok and words in verdict, verdict


@pytest.mark.parametrize("predicted", [MEASURED, MEASURED * (1 + WITHIN) * 0.999, MEASURED * (1 - WITHIN) * 1.001,
                                       PARTS["total"]])
def test_a_prediction_within_five_percent_of_the_measurement_passes(predicted):
    ok, verdict = judge_peak(predicted, PARTS, MEASURED)
    assert ok and "within 5%" in verdict and f"{MEASURED:,.0f} B" in verdict, verdict


def test_just_outside_the_share_fails():
    assert not judge_peak(MEASURED * (1 + WITHIN) * 1.001, PARTS, MEASURED)[0]
    assert not judge_peak(MEASURED * (1 - WITHIN) * 0.999, PARTS, MEASURED)[0]

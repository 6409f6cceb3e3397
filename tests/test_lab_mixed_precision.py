"""The mixed-precision lab: blank skeletons fail naming the method, both answer keys pass, every planted mistake --
none of them a known mistake -- fails on the property it breaks with a verdict that says where, and ranks that do
not agree on an overflow fail both the step alone and ZeRO-2's training, the known mistake named."""
from __future__ import annotations

from pathlib import Path

import pytest

from minizero.course.labs import LABS, check
from minizero.course.labs.check import Checker
from minizero.course.labs.failed import Failed
from minizero.course.labs.loading import Impl
from minizero.course.labs.mistakes_precision import MISTAKES, NeverUnscales, OwnOverflowVerdict
from minizero.course.labs.properties_precision import mixed_training

HERE = Path(__file__).parent
STEP = "the mixed-precision step on every rank"


def quiet(_):
    pass


@pytest.mark.parametrize("mistake", MISTAKES, ids=lambda m: m.name)
def test_a_known_mistake_is_named(pools, mistake):
    report = check("mixed-precision", impl=mistake, examples=2, pools=pools, out=quiet, shrink_s=0)
    assert report.failed == STEP and report.mistake == mistake.mistake, report


def test_ranks_that_do_not_agree_on_an_overflow_fail_the_step_alone(pools):
    """An inf in rank 1's gradient only: rank 1 skips, rank 0 -- deciding on its own shard -- steps."""
    report = check("mixed-precision", impl=OwnOverflowVerdict, examples=2, pools=pools, out=quiet, shrink_s=0)
    assert report.why.startswith("step 1: the ranks disagree -- rank(s) [") and "skipped the step" in report.why, \
        report.why


def test_ranks_that_do_not_agree_on_an_overflow_fail_zero2_training(pools):
    """The same slip inside ZeRO-2 (an inf in rank 1's gradient at step 2): the rank that took the step all-gathers
    its shard while the other, having skipped, has moved on -- the collectives disagree, and the verdict says why."""
    lab = LABS["mixed-precision"]
    with pytest.raises(Failed) as failed:
        mixed_training(Checker(lab, Impl.of(lab, OwnOverflowVerdict), pools, examples=2, shrink_s=0))
    assert "ranks disagree on the next collective" in failed.value.why
    assert "did every rank skip the same steps?" in failed.value.why and "3 step(s)" in failed.value.case


def test_a_step_on_scaled_gradients_fails_zero2_training_named(pools):
    lab = LABS["mixed-precision"]
    with pytest.raises(Failed) as failed:
        mixed_training(Checker(lab, Impl.of(lab, NeverUnscales), pools, examples=2, shrink_s=0))
    assert "rank 0's" in failed.value.why and failed.value.mistake == NeverUnscales.mistake


def test_a_step_that_refuses_one_halving_above_the_floor_is_told_the_package_skipped(pools):
    """The explicit case at loss scale 2 (issue 45): a step that tells the scaler before looking at the floor raises
    where the package skips and halves -- told so, with the scale the step began with and the one it halved to."""
    mistake = Path(__file__).parent / "lab_mistakes" / "mixed_precision" / "halves_before_refusing.py"
    report = check("mixed-precision", impl=str(mistake), examples=3, pools=pools, out=quiet, shrink_s=0)
    assert report.failed == "the mixed-precision step on every rank", report
    assert "FloatingPointError" in report.why and "loss scale 2" in report.case
    assert "the package skipped this step: at loss scale 2 an overflow halves the scale, to 1" in report.why, report.why

"""The mixed-precision lab: blank skeletons fail naming the method, both answer keys pass, every planted mistake --
none of them a known mistake -- fails on the property it breaks with a verdict that says where, and ranks that do
not agree on an overflow fail both the step alone and ZeRO-2's training, the known mistake named."""
from __future__ import annotations

from pathlib import Path

import pytest

from minizero.labs import LABS, check
from minizero.labs.catalogue import SKELETONS
from minizero.labs.check import Checker
from minizero.labs.failed import Failed
from minizero.labs.loading import Impl
from minizero.labs.mistakes_precision import MISTAKES, NeverUnscales, OwnOverflowVerdict
from minizero.labs.properties_precision import mixed_training

HERE = Path(__file__).parent
STEP = "the mixed-precision step on every rank"

#: Each planted slip, and words its verdict must have (every one fails the step alone: drawn, or the agreement case).
PLANTED = {
    "agrees_by_average": "step 1, rank 0's master 1: the step was taken and moved it by",
    "checks_nan_only": "step 1, rank 0's master 1: the step was taken and moved it by",
    "keeps_the_fp32_gradients": "step 1, rank 0's master(s) [0]: their fp32 gradients are still held after step()",
    "never_tells_the_scaler": "step 1, rank 0's loss scale: 1024 after 0 skipped step(s), should be 512 after 1 (too "
                              "large)",
    "rounds_before_the_step": "step 1, rank 0's working copy 0: element 1 is -0.56640625, should be -0.5703125 -- it "
                              "never moved in this step",
    "step_returns_nothing": "step 1, rank 0's step() returned None after a step that should be taken",
    "unscales_at_every_call": "step 1, rank 0's all-reduces: 2, too large a count",
    "unscales_in_16_bits": "its update is almost the right length",
}


def quiet(_):
    pass


@pytest.mark.parametrize("level", ["contract", "guided"])
def test_a_blank_skeleton_fails_naming_the_method(pools, level):
    report = check("mixed-precision", impl=SKELETONS / level / "mixed_precision.py", examples=2, pools=pools, out=quiet,
                   shrink_s=1.0)
    assert report.failed == STEP and report.case.startswith("world size 1"), report
    assert "NotImplementedError: write MasterWeights.step" in report.why, report.why


@pytest.mark.parametrize("level", ["contract", "guided"])
def test_the_answer_key_passes_at_both_levels(pools, level):
    report = check("mixed-precision", impl=HERE / "lab_solutions" / level / "mixed_precision.py", examples=3,
                   pools=pools, out=quiet)
    assert report.ok, (report.failed, report.why, report.case)
    assert report.passed == ["your methods are what runs", STEP, "ZeRO-2 with your masters equals the same-recipe "
                                                                 "reference"]


@pytest.mark.parametrize("name", sorted(PLANTED))
def test_a_planted_mistake_fails_saying_where(pools, name):
    report = check("mixed-precision", impl=HERE / "lab_mistakes" / "mixed_precision" / f"{name}.py", examples=3,
                   pools=pools, out=quiet, shrink_s=1.0)
    assert report.failed == STEP, report
    assert PLANTED[name] in report.why, report.why
    assert report.mistake is None  # not a known mistake: nothing is named


def test_every_planted_file_is_tested_and_says_its_slip():
    files = sorted((HERE / "lab_mistakes" / "mixed_precision").glob("*.py"))
    assert [f.stem for f in files] == sorted(PLANTED)
    assert all(f.read_text().startswith('"""') for f in files)


@pytest.mark.parametrize("mistake", MISTAKES, ids=lambda m: m.name)
def test_a_known_mistake_is_named(pools, mistake):
    report = check("mixed-precision", impl=mistake, examples=2, pools=pools, out=quiet, shrink_s=1.0)
    assert report.failed == STEP and report.mistake == mistake.mistake, report


def test_ranks_that_do_not_agree_on_an_overflow_fail_the_step_alone(pools):
    """An inf in rank 1's gradient only: rank 1 skips, rank 0 -- deciding on its own shard -- steps."""
    report = check("mixed-precision", impl=OwnOverflowVerdict, examples=2, pools=pools, out=quiet, shrink_s=1.0)
    assert report.why.startswith("step 1: the ranks disagree -- rank(s) [") and "skipped the step" in report.why, \
        report.why


def test_ranks_that_do_not_agree_on_an_overflow_fail_zero2_training(pools):
    """The same slip inside ZeRO-2 (an inf in rank 1's gradient at step 2): the rank that took the step all-gathers
    its shard while the other, having skipped, has moved on -- the collectives disagree, and the verdict says why."""
    lab = LABS["mixed-precision"]
    with pytest.raises(Failed) as failed:
        mixed_training(Checker(lab, Impl.of(lab, OwnOverflowVerdict), pools, examples=2, shrink_s=1.0))
    assert "ranks disagree on the next collective" in failed.value.why
    assert "did every rank skip the same steps?" in failed.value.why and "3 step(s)" in failed.value.case


def test_a_step_on_scaled_gradients_fails_zero2_training_named(pools):
    lab = LABS["mixed-precision"]
    with pytest.raises(Failed) as failed:
        mixed_training(Checker(lab, Impl.of(lab, NeverUnscales), pools, examples=2, shrink_s=1.0))
    assert "rank 0's" in failed.value.why and failed.value.mistake == NeverUnscales.mistake

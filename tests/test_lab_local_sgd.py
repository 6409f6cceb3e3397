"""The local-SGD lab: blank skeletons fail naming the method, both answer keys pass, every planted mistake -- none of
them a known mistake -- fails on the property it breaks with a verdict that says where, and the known ones are named.
"""
from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from minizero.lab.experiment import Experiment
from minizero.labs import LABS, check
from minizero.labs.catalogue import SKELETONS
from minizero.labs.mistakes_local_sgd import MISTAKES
from minizero.labs.properties_local_sgd import departs

HERE = Path(__file__).parent
H1 = "H = 1 with plain SGD is single-device training"
PACKAGE = "every rank, every step, the package's local SGD"
BYTES = "bytes: one all-reduce of the parameters every H steps"

#: Each planted slip, the property that catches it, and words its verdict must have.
PLANTED = {
    "averages_a_copy": (H1, "the ranks disagree"),
    "averages_at_the_first_step": (PACKAGE, "after step 1 (H = 2: a local step), rank 0's layers.0.weight differs "
                                            "from the package's local SGD"),
    "averages_before_the_local_step": (H1, "the ranks disagree"),
    "averages_in_double": (BYTES, "from step 1 to step 4: 264 bytes a step each on average as ['all_reduce']"),
    "averages_the_gradients": (H1, "the ranks disagree"),
    "fresh_outer_optimizer": (PACKAGE, "after step 4 (H = 2: an averaging step), rank 0's layers.0.weight differs "
                                       "from the package's local SGD by 0.0109 -- its update points another way"),
    "ignores_the_outer_optimizer": (PACKAGE, "after step 2 (H = 2: an averaging step), rank 0's"),
    "outer_step_not_copied_back": (PACKAGE, "the outer step (DiLoCo, outer lr 0.7, momentum 0.9)"),
}


def quiet(_):
    pass


@pytest.mark.parametrize("level", ["contract", "guided"])
def test_a_blank_skeleton_fails_naming_the_method(pools, level):
    report = check("local-sgd", impl=SKELETONS / level / "local_sgd.py", examples=2, pools=pools, out=quiet,
                   shrink_s=1.0)
    assert report.failed == H1 and report.case.startswith("world size 1"), report
    assert "NotImplementedError: write LocalSGD.step" in report.why, report.why


@pytest.mark.parametrize("level", ["contract", "guided"])
def test_the_answer_key_passes_at_both_levels(pools, level):
    report = check("local-sgd", impl=HERE / "lab_solutions" / level / "local_sgd.py", examples=2, pools=pools,
                   out=quiet)
    assert report.ok, (report.failed, report.why, report.case)
    assert report.passed == ["your methods are what runs", H1, PACKAGE, BYTES]


@pytest.mark.parametrize("name", sorted(PLANTED))
def test_a_planted_mistake_fails_saying_where(pools, name):
    failing, words = PLANTED[name]
    report = check("local-sgd", impl=HERE / "lab_mistakes" / "local_sgd" / f"{name}.py", examples=2, pools=pools,
                   out=quiet, shrink_s=1.0)
    assert report.failed == failing, report
    assert words in report.why, report.why
    assert report.mistake is None  # not a known mistake: nothing is named


def test_every_planted_file_is_tested_and_says_its_slip():
    files = sorted((HERE / "lab_mistakes" / "local_sgd").glob("*.py"))
    assert [f.stem for f in files] == sorted(PLANTED)
    assert all(f.read_text().startswith('"""') for f in files)


@pytest.mark.parametrize("mistake", MISTAKES, ids=lambda m: m.name)
def test_a_known_mistake_is_named(pools, mistake):
    report = check("local-sgd", impl=mistake, examples=2, pools=pools, out=quiet, shrink_s=1.0)
    assert report.failed in (H1, PACKAGE) and report.mistake == mistake.mistake, report


def test_the_package_s_departure_is_said_as_an_average_in_the_wrong_place(pools):
    """The comparison itself: local SGD with H = 2 against H = 3 on the same run departs at step 2, where one
    averaged and the other did not -- and two identical runs do not depart at all."""
    exp = Experiment(stage="local-sgd", task="mlp", optimizer="momentum", lr=0.05, steps=3, dtype="float64",
                     options={"average_every": 2})
    two = pools.run(3, _run, exp)
    three = pools.run(3, _run, replace(exp, options={"average_every": 3}))
    assert departs(two, two, exp) is None
    why = departs(two, three, exp)
    assert why.startswith("after step 2 (H = 2: an averaging step), rank 0's") and "your ranks agree" in why, why
    assert LABS["local-sgd"].answer.name == "local-sgd"


def _run(me, exp):
    from minizero.lab.experiment import run_experiment
    return run_experiment(me, exp)

"""The local-SGD lab: blank skeletons fail naming the method, both answer keys pass, every planted mistake -- none of
them a known mistake -- fails on the property it breaks with a verdict that says where, and the known ones are named.
"""
from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from minizero.course.harness.experiment import Experiment
from minizero.course.labs import LABS, check
from minizero.course.labs.mistakes_local_sgd import MISTAKES
from minizero.course.labs.properties_local_sgd import departs

HERE = Path(__file__).parent
H1 = "H = 1 with plain SGD is single-device training"
PACKAGE = "every rank, every step, the package's local SGD"
BYTES = "bytes: one all-reduce of the parameters every H steps"


def quiet(_):
    pass


@pytest.mark.parametrize("mistake", MISTAKES, ids=lambda m: m.name)
def test_a_known_mistake_is_named(pools, mistake):
    report = check("local-sgd", impl=mistake, examples=2, pools=pools, out=quiet, shrink_s=0)
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
    from minizero.course.harness.experiment import run_experiment
    return run_experiment(me, exp)

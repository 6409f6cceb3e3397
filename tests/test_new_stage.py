"""Adding a stage is one file and one registry line: ``compare``, the equivalence property, the byte check
and the memory check come with it, reading the stage's facts from its class."""
from __future__ import annotations

from hypothesis import given, settings

from minizero.lab.compare import compare
from minizero.lab.experiment import Experiment
from minizero.lab.registry import LAB_STAGES
from minizero.stages import STAGES, with_stages
from tests.equivalence import covering, examples, experiments, run_and_check
from tests.extra_stage import AllGatherDDP, WrongFormula

EXTRA = with_stages(AllGatherDDP, WrongFormula, base=LAB_STAGES)  # a copy: the package's registry is untouched


def test_the_registry_copy_leaves_the_package_registry_alone():
    assert "ddp-all-gather" in EXTRA and "ddp-all-gather" not in STAGES and "ddp-all-gather" not in LAB_STAGES


def test_compare_checks_a_new_stage_against_its_own_formulas():
    rows = compare(3, ["ddp-all-gather", "ddp-all-gather-claims-ring"],
                   Experiment(task="mlp", dtype="float64", steps=2, accum=2, stages=EXTRA), timeout_s=30)
    right, wrong = rows
    assert right.within_tolerance and right.bytes_match and right.memory_match, right
    ratio = right.sent_bytes_per_step / wrong.sent_bytes_formula  # (N-1) Psi b against 2(N-1)/N Psi b: N/2
    assert abs(ratio - 3 / 2) < 1e-9, ratio
    assert wrong.within_tolerance and not wrong.bytes_match, wrong  # the byte check can say no


@covering
@settings(max_examples=examples(8))
@given(drawn=experiments("ddp-all-gather", stages=EXTRA))
def test_a_new_stage_gets_the_equivalence_property(pools, drawn):
    exp, world_size = drawn
    run_and_check(pools, exp, world_size)

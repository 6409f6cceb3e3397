"""Adding a stage is one file and one registry call: ``compare``, the equivalence property, the byte check and
the memory check come with it, reading the stage's facts from its class -- and so do its options: a new option,
declared once beside the stage (``tests/extra_stage.py``), is a flag of ``compare`` and is drawn by the property
suite, with no line anywhere else."""
from __future__ import annotations

import contextlib
import functools
import io
import json

import pytest
from hypothesis import given, settings

from minizero.__main__ import main, parser
from minizero.course.commands.compare import compare
from minizero.course.harness.drawn import drawing_for
from minizero.course.harness.experiment import Experiment, build
from minizero.course.harness.registry import LAB_STAGES
from minizero.stages import STAGES, with_stages
from tests.equivalence import covering, examples, experiments, run_and_check
from tests.extra_stage import GATHERS, AllGatherDDP, SplitAllGatherDDP, WrongFormula

#: The one registry call, a copy: the package's registry is untouched.
EXTRA = with_stages(AllGatherDDP, SplitAllGatherDDP, WrongFormula, base=LAB_STAGES)
SPLIT = SplitAllGatherDDP.name


def test_the_registry_copy_leaves_the_package_registry_alone():
    for name in (AllGatherDDP.name, SPLIT):
        assert name in EXTRA and name not in STAGES and name not in LAB_STAGES


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


# ------------------------------------------------------------------ a new option: a flag, and a drawn value
def test_the_new_option_is_a_flag_that_parses_by_its_declaration(capsys):
    args = parser(EXTRA).parse_args(["compare", "--stages", SPLIT, "--gathers", "3"])
    assert args.gathers == 3
    assert parser(EXTRA).parse_args(["compare"]).gathers is None  # not given: the stage's default holds
    for text, words in (("0", "argument --gathers: 0 is not a positive whole number (1 or more)"),
                        ("two", "argument --gathers: 'two' is not a whole number")):
        with pytest.raises(SystemExit):
            parser(EXTRA).parse_args(["compare", "--gathers", text])
        assert words in capsys.readouterr().err
    with pytest.raises(SystemExit):  # the package's own command line has no such flag
        parser().parse_args(["compare", "--gathers", "3"])
    assert "unrecognized arguments: --gathers 3" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        parser(EXTRA).parse_args(["compare", "--help"])
    assert f"{SPLIT}: {GATHERS.help} (default 1)" in " ".join(capsys.readouterr().out.split())


def test_the_new_option_given_to_stages_that_do_not_take_it_is_refused(capsys):
    assert main(["compare", "--stages", "ddp,ddp-all-gather", "--gathers", "2"], stages=EXTRA) == 2
    assert ("error: --gathers has no effect on --stages ddp,ddp-all-gather: none of them takes it (it is an option "
            f"of {SPLIT})") in capsys.readouterr().err


def _compare_json(*argv) -> dict:
    with contextlib.redirect_stdout(io.StringIO()) as out:
        status = main(["compare", "--stages", SPLIT, "--world-size", "3", "--task", "mlp", "--dtype", "float64",
                       "--steps", "2", "--accum", "2", "--json", *argv], stages=EXTRA)
    row, = json.loads(out.getvalue())
    assert status == 0 and row["within_tolerance"] and row["bytes_match"] and row["memory_match"], row
    return row


def test_compare_runs_the_new_stage_with_its_flag():
    """``--gathers 3`` reaches the stage on every rank: the same bytes, in three collectives instead of one --
    three fingerprints a step, which every collective exchanges (``--check``, on by default)."""
    one, three = _compare_json(), _compare_json("--gathers", "3")
    assert three["sent_bytes_per_step"] == one["sent_bytes_per_step"] > 0
    assert three["check_bytes_per_step"] == 3 * one["check_bytes_per_step"] > 0, (one, three)


def _gathers_on_rank(me, exp) -> int:
    stage, _, comm, _ = build(me, exp)
    comm.close()
    return stage.gathers


def drawing_every_declared_value(test):
    """After the property: its examples drew each value the declaration offers (1, 2 and 3 gathers) -- the suite
    read the option from the stage's declaration, not from a default.  Put it above ``@settings``."""
    @functools.wraps(test)
    def property_then_values(*args, **kwargs):
        _DRAWN_GATHERS.clear()
        test(*args, **kwargs)
        offered = set(GATHERS.draw(drawing_for(4, "mlp")))
        assert _DRAWN_GATHERS == offered, f"the drawn examples had {sorted(_DRAWN_GATHERS)} gathers, not {offered}"
    return property_then_values


_DRAWN_GATHERS: set = set()


@covering
@drawing_every_declared_value
@settings(max_examples=examples(10))
@given(drawn=experiments(SPLIT, stages=EXTRA))
def test_a_new_option_is_drawn_from_its_declaration_and_reaches_the_stage(pools, drawn):
    exp, world_size = drawn
    gathers = exp.options.get("gathers", GATHERS.default)  # left out: the default (the check below then fails)
    _DRAWN_GATHERS.add(gathers)
    assert pools.run(world_size, _gathers_on_rank, exp) == [gathers] * world_size
    run_and_check(pools, exp, world_size)

"""The stages' options are declared once (``minizero.stages.options``), and the command line and the drawn
experiments are built from those declarations: every declared option is a flag of every command that runs its
stage, parsed, refused and explained by its declaration; a flag left out gives the stage nothing; the suite draws
what the declaration offers, in its order.  (No ranks: these cost milliseconds.)"""
from __future__ import annotations

import argparse

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from minizero.__main__ import main, parser
from minizero.course.harness import option_flags
from minizero.course.harness.drawn import drawing_for, stage_options
from minizero.stages import STAGES, distributed
from minizero.stages.options import WIRE_AND_USE, Option, choice, natural_int, positive_float, positive_int

#: What each command leaves to flags of its own: compare, soak and train build ``precision`` from theirs; scale
#: reads bytes per element from --precision, and the wire's options are no part of its cost model.
LEFT_OUT = {"compare": {"precision"}, "soak": {"precision"}, "train": {"precision"},
            "scale": {o.name for o in WIRE_AND_USE}}


def command(name: str, stages: dict | None = None) -> argparse.ArgumentParser:
    subparsers = next(a for a in parser(stages)._actions if isinstance(a, argparse._SubParsersAction))
    return subparsers.choices[name]


def flags(p: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    return {s: a for a in p._actions for s in a.option_strings}


def declared_options() -> list[tuple[str, Option]]:
    return [(stage, o) for stage in distributed() for o in STAGES[stage].options]


@pytest.mark.parametrize("name", sorted(LEFT_OUT))
def test_every_declared_option_is_a_flag_of_every_command_that_runs_its_stage(name):
    have = flags(command(name))
    for stage, option in declared_options():
        if option.name in LEFT_OUT[name]:
            continue
        if not option_flags.on_command_line(option):  # zero3's units: a list of submodules, the API's alone
            assert option.flag not in have, (name, option)
            continue
        action = have.get(option.flag)
        assert action is not None, f"{name} has no {option.flag} for {stage}'s option {option.name!r}"
        assert action.dest == option.name and action.default is None, (name, option, action)  # None: not given
        assert option.help in action.help and (stage in action.help or "every stage" in action.help), action.help


@pytest.mark.parametrize("name", ["compare", "train"])
@pytest.mark.parametrize("text", ["x", "-1", "0", "1", "2.5", "nan", "inf", "none", "fp16"])
def test_a_flag_parses_and_refuses_as_its_declaration_does(capsys, name, text):
    for _, option in {o.name: (s, o) for s, o in declared_options()}.values():
        if option.parse is None or option.name in LEFT_OUT[name]:
            continue
        try:
            want = option.parse(text)
        except argparse.ArgumentTypeError as error:
            with pytest.raises(SystemExit) as raised:
                parser().parse_args([name, option.flag, text])
            assert raised.value.code == 2 and f"argument {option.flag}: {error}" in capsys.readouterr().err
            continue
        got = getattr(parser().parse_args([name, option.flag, text]), option.name)
        assert got == (None if text == "none" else want), (option, text, got)  # "none": the default, not given


def test_a_switch_is_a_flag_and_one_on_by_default_can_be_turned_off():
    assert parser().parse_args(["compare", "--error-feedback"]).error_feedback is True
    assert parser().parse_args(["compare", "--no-reshard-after-forward"]).reshard_after_forward is False
    assert parser().parse_args(["compare", "--reshard-after-forward"]).reshard_after_forward is True
    args = parser().parse_args(["compare"])
    assert args.error_feedback is None and args.reshard_after_forward is None
    assert option_flags.given(args) == {}


def test_an_option_no_chosen_stage_takes_is_refused_naming_the_stages_that_do(capsys):
    assert main(["compare", "--stages", "ddp,zero1", "--no-reshard-after-forward"]) == 2
    assert ("error: --reshard-after-forward has no effect on --stages ddp,zero1: none of them takes it (it is an "
            "option of zero3, zeropp, hsdp)") in capsys.readouterr().err
    assert main(["train", "--stage", "ddp", "--bucket-mb", "5"]) == 2
    assert "error: --stage ddp takes no --bucket-mb (its options: compress, error_feedback" in capsys.readouterr().err


# ------------------------------------------------------------------ stages declared here, as a test would
class _Declares:
    def __init__(self, *options):
        self.options = options


def test_two_stages_that_parse_one_name_differently_cannot_share_its_flag():
    stages = {"a": _Declares(Option("depth", 1, "a's", positive_int)), "b": _Declares(Option("depth", 1, "b's", natural_int))}
    with pytest.raises(TypeError, match="stages 'a' and 'b' both declare an option 'depth' but parse it differently"):
        option_flags.declared(stages)
    shared = Option("depth", 1, "one declaration", positive_int)
    assert option_flags.declared({"a": _Declares(shared), "b": _Declares(shared)}) == [shared]


def test_an_option_named_like_a_flag_of_the_command_is_refused_naming_it():
    stages = {"ddp": STAGES["ddp"], "seedy": _Declares(Option("seed", 0, "a seed of its own", natural_int))}
    with pytest.raises(TypeError, match=r"stage option 'seed' \(seedy\) would be the flag --seed, which python -m "
                                        r"minizero compare already has"):
        parser(stages)


def test_a_new_option_is_a_flag_with_its_help_type_and_choices():
    stages = {"ddp": STAGES["ddp"], "mine": _Declares(Option("wire_order", None, "how 100% of it goes",
                                                             choice("none", "up", "down")),
                                                      Option("rate", 0.5, "a rate", positive_float))}
    args = parser(stages).parse_args(["compare", "--stages", "mine", "--wire-order", "up", "--rate", "2"])
    assert (args.wire_order, args.rate) == ("up", 2.0)
    assert option_flags.given(args) == {"wire_order": "up", "rate": 2.0}
    assert parser(stages).parse_args(["compare", "--wire-order", "none"]).wire_order is None
    help = command("compare", stages).format_help()
    assert "--wire-order {none,up,down}" in help and "how 100% of it goes" in help and "(default 0.5)" in help


# ------------------------------------------------------------------ the drawn experiments
class _Drawn:
    name = "drawn"
    options = (Option("first", 1, "", positive_int, draw=lambda d: range(1, d.world_size + 1)),
               Option("never", 1, "", positive_int),  # no draw: left at its default
               Option("edge_only", False, "", None, draw=lambda d: (True,) if d.unused_parameters else ()),
               Option("last", "b", "", choice("a", "b"), draw=lambda d: ("a", "b")))


@settings(max_examples=20)
@given(data=st.data(), world_size=st.integers(1, 4), task=st.sampled_from(["mlp", "edge"]))
def test_the_suite_draws_each_option_from_its_declaration_in_its_order(data, world_size, task):
    options = data.draw(stage_options("drawn", task, stages={"drawn": _Drawn}, world_size=world_size))
    assert list(options) == ["first", "edge_only", "last"] if task == "edge" else ["first", "last"]
    assert 1 <= options["first"] <= world_size and options["last"] in ("a", "b")
    assert options.get("edge_only", True) is True


#: What the suite drew for the package's stages before their options were declared, now from the declarations:
#: servers up to N, the bucket caps, zero3's prefetch and resharding (and unused parameters on the edge model).
DRAWN_BEFORE = {"ps": {"servers"}, "ps-async": {"servers"}, "ddp-bucketed": {"bucket_mb"}, "zero2": {"bucket_mb"},
                "zero3": {"prefetch", "reshard_after_forward"}, "ddp": set(), "zero1": set(), "local-sgd": set()}


@settings(max_examples=30)
@given(data=st.data(), stage=st.sampled_from(sorted(DRAWN_BEFORE)), task=st.sampled_from(["mlp", "edge", "gpt"]))
def test_the_package_stages_draws_are_their_declarations(data, stage, task):
    """Each option a stage declares a draw for, and nothing else -- what was drawn before among them."""
    drawn = data.draw(stage_options(stage, task, world_size=3))
    offered = {o.name: o.draw(drawing_for(3, task)) for o in STAGES[stage].options if o.draw is not None}
    edge = {"find_unused_parameters"} if task == "edge" and stage != "local-sgd" else set()
    assert set(drawn) == {name for name, values in offered.items() if len(values)}, (stage, task, drawn)
    assert DRAWN_BEFORE[stage] | edge <= set(drawn), (stage, task, drawn)
    assert all(value in offered[name] for name, value in drawn.items()), (stage, task, drawn)

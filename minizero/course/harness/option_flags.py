"""The command line's flags for the stages' options, read from the stages' own declarations.

A stage declares each keyword option once (:mod:`minizero.stages.options`): its name, default, help and how
the command line parses it.  Each command that runs stages (``compare``, ``soak``, ``train``, ``scale``) adds
one flag per option of the stages it can run, from those facts alone -- so a stage with a new option has its
flag, parsed and explained, without a line here or in the command.

A flag left out is None, "not given": the stage's own default then holds, and a stage that does not take the
option is not handed it.  An option given to a run none of whose stages takes it is refused by the command,
naming the stages that do (:func:`refuse_unused`).
"""
from __future__ import annotations

import argparse

from ...stages import REFERENCE
from ...stages.options import Option


def on_command_line(option: Option) -> bool:
    """Whether the option has a command-line form: a parser, or a switch (a bool default).  One whose value is
    a Python object -- zero3's ``units``, a list of submodules -- is given through the API only."""
    return option.parse is not None or isinstance(option.default, bool)


def declared(stages: dict, leave_out=()) -> list[Option]:
    """Every option the ``stages`` declare that the command line can give, once by name, first declared first.
    ``leave_out``: names the command gives in its own way (``compare`` builds ``precision`` from several flags).

    Stages that share an option (``bucket_mb``, ``servers``) share its declaration; two declarations of one
    name must parse alike, since one flag cannot parse two ways."""
    first: dict[str, tuple[Option, str]] = {}
    for stage, cls in stages.items():
        for option in getattr(cls, "options", ()):  # torch's oracles declare none
            if option.name in leave_out or not on_command_line(option):
                continue
            seen, by = first.setdefault(option.name, (option, stage))
            if seen.parse is not option.parse or isinstance(seen.default, bool) != isinstance(option.default, bool):
                raise TypeError(f"stages {by!r} and {stage!r} both declare an option {option.name!r} but parse it "
                                f"differently, so it cannot be one flag {option.flag}: share one Option (as "
                                f"minizero.stages.options.BUCKET_MB is shared), or give one of them another name")
    return [option for option, _ in first.values()]


def takers(stages: dict, name: str) -> list[str]:
    """The stages (single-device training aside) that declare option ``name``."""
    return [stage for stage, cls in stages.items()
            if stage != REFERENCE and name in [o.name for o in getattr(cls, "options", ())]]


def _who(stages: dict, name: str) -> str:
    """Which stages take option ``name``, in the fewest words: "zero3", or "every stage but local-sgd"."""
    takes = takers(stages, name)
    declaring = [s for s, cls in stages.items() if s != REFERENCE and hasattr(cls, "options")]  # not torch's
    others = [s for s in declaring if s not in takes]
    if not others:
        return "every stage"
    return f"every stage but {', '.join(others)}" if len(others) < len(takes) else ", ".join(takes)


def _default_text(default) -> str | None:
    if isinstance(default, bool):
        return "on" if default else "off"
    return f"{default:g}" if isinstance(default, float) else None if default is None else str(default)


def _parse_none_as_default(option: Option):
    """``--compress none``: the text "none" of an option whose default is None is that default, not given."""
    def parse(text: str):
        return None if text == "none" else option.parse(text)
    parse.__name__ = getattr(option.parse, "__name__", option.name)  # argparse names it in "invalid ... value"
    return parse


def add_flags(parser: argparse.ArgumentParser, stages: dict, leave_out=(), command: str = "") -> list[Option]:
    """One flag per option of ``stages`` (:func:`declared`), default None; the parsed namespace remembers which
    they are (:func:`given`).  A switch is ``--flag`` (default off) or ``--flag/--no-flag`` (default on).  Called
    after the command's own flags, so that an option named like one of them is refused here, named."""
    options = declared(stages, leave_out)
    group = parser.add_argument_group("the stages' options", "each given to the chosen stages that take it; left "
                                      "out, a stage keeps its default (minizero.stages.options)")
    for option in options:
        text = option.help.replace("%", "%%")  # argparse formats help with %
        default = _default_text(option.default)
        help = f"{_who(stages, option.name)}: {text}" + ("" if default is None else f" (default {default})")
        kwargs: dict = {"dest": option.name, "default": None, "help": help}
        if option.parse is None:
            kwargs["action"] = argparse.BooleanOptionalAction if option.default else "store_true"
        elif option.default is None and "none" in getattr(option.parse, "choices", ()):
            kwargs.update(type=_parse_none_as_default(option), metavar="{" + ",".join(option.parse.choices) + "}")
        else:
            kwargs["type"] = option.parse
            if hasattr(option.parse, "choices"):
                kwargs["metavar"] = "{" + ",".join(option.parse.choices) + "}"
        try:
            group.add_argument(option.flag, **kwargs)
        except argparse.ArgumentError as clash:
            raise TypeError(f"stage option {option.name!r} ({', '.join(takers(stages, option.name))}) would be the "
                            f"flag {option.flag}, which {command or 'the command'} already has for something else "
                            f"({clash}); rename the option") from None
    parser.set_defaults(stage_option_names=tuple(o.name for o in options))
    return options


def given(args) -> dict:
    """The stage options given on the command line, by keyword (a flag left out is not there)."""
    names = getattr(args, "stage_option_names", ())
    return {name: getattr(args, name) for name in names if getattr(args, name) is not None}


def refuse_unused(chosen: list[str], stages: dict, options: dict) -> None:
    """An option that none of the ``chosen`` stages takes would change nothing: refused, naming the stages that
    do (``compare``, ``soak``: a run of several stages gives each the options it takes)."""
    for name, value in options.items():
        if value is None or value == "none":  # "none": the wire's spelling of not given (compress="none")
            continue
        if not takers({s: stages[s] for s in chosen}, name):
            flag = "--" + name.replace("_", "-")
            raise ValueError(f"{flag} has no effect on --stages {','.join(chosen)}: none of them takes it (it is an "
                             f"option of {', '.join(takers(stages, name)) or 'no stage'}); add such a stage, or drop "
                             f"{flag}")

"""A stage's options, declared once as facts of the stage.

Each stage lists the keyword options its constructor takes as :class:`Option` s
(``ZeRO2.options``): the name, the default, one line of help, how the command
line parses it, and which values the property suite draws.  Everything outside
the stage -- ``make_stage``, the CLI's flags (``compare``, ``train``, ``soak``,
``bench``), the drawn experiments, the docs -- is built from these
declarations, so a stage with a new option is still one file and one registry
line (``tests/test_new_stage.py`` adds one from a test file).

The options most stages share (the wire, unused parameters, precision,
buckets) are declared here once and listed by the stages that take them.
The constructors take the cross-cutting ones as policy objects, as FSDP2's
``fully_shard`` does (``wire=WirePolicy(...)``, ``precision=Precision(...)``,
``offload=OffloadPolicy(...)``); an option declared ``into`` a policy is one
of its fields, and :func:`constructor_keywords` builds the object from them.
"""
from __future__ import annotations

import argparse
import inspect
import math
from dataclasses import dataclass, fields
from typing import Callable, Sequence

from ..compress import WirePolicy
from ..parts.buckets import MAX_IN_FLIGHT
from ..parts.offload import OffloadPolicy

#: The constructors' policy keywords, and the class each one takes.
POLICIES = {"wire": WirePolicy, "offload": OffloadPolicy}


@dataclass(frozen=True)
class Drawing:
    """What a drawn value may depend on: the experiment's world size, and what its model offers -- the submodules
    that may be kept whole (``replicable``: each choice a tuple of names, or None for none) and whether a parameter
    never gets a gradient (``unused_parameters``).  The course fills it from its task's model."""

    world_size: int
    replicable: tuple = (None,)
    unused_parameters: bool = False


@dataclass(frozen=True)
class Option:
    """One keyword option of a stage's constructor.

    ``parse``: the command line's text to a value, raising ``argparse.ArgumentTypeError`` that says what is
    wrong; ``None``: a switch if the default is a bool (``--flag``, or ``--flag``/``--no-flag`` when it is on by
    default), otherwise no command-line form at all (``units``, ``replicate``: modules).
    ``draw``: the values the property suite samples
    from, given a :class:`Drawing` (``None``: not drawn by the suite on its own -- the wire and precision are
    drawn by the suite's modes, ``compress=True`` and ``precision=True``).
    ``into``: ``(policy, field)`` when the constructor takes this option as a field of a policy object
    (:data:`POLICIES`): ``compress`` is ``wire.compress``."""

    name: str
    default: object
    help: str
    parse: Callable[[str], object] | None = str
    draw: Callable[[Drawing], Sequence] | None = None
    into: tuple[str, str] | None = None

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")


# ---------------------------------------------------------------------- parsers, in the command line's words
def _number(text: str, kind: type, what: str):
    try:
        value = kind(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not {what}") from None
    return value


def positive_int(text: str) -> int:
    """A count: a whole number >= 1."""
    value = _number(text, int, "a whole number")
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} is not a positive whole number (1 or more)")
    return value


def natural_int(text: str) -> int:
    """A count that may be zero: a whole number >= 0."""
    value = _number(text, int, "a whole number")
    if value < 0:
        raise argparse.ArgumentTypeError(f"{value} is negative; use 0 or more")
    return value


def positive_float(text: str) -> float:
    """A size or a rate: a finite number greater than 0."""
    value = _number(text, float, "a number")
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"{text} is not a finite number greater than 0")
    return value


def finite_float(text: str) -> float:
    value = _number(text, float, "a number")
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"{text} is not a finite number")
    return value


def choice(*values: str) -> Callable[[str], str]:
    def parse(text: str) -> str:
        if text not in values:
            raise argparse.ArgumentTypeError(f"{text!r} is not one of {', '.join(values)}")
        return text
    parse.choices = values  # what argparse's help lists
    return parse


def _checked(build, flag: str):
    """A parser for ``flag`` that builds the value with ``build`` now, so a bad one is refused before any rank."""
    def parse(text: str) -> str:
        try:
            build(text)
        except ValueError as refused:
            raise argparse.ArgumentTypeError(str(refused)) from None
        return text
    parse.__doc__ = f"``{flag}``: checked when parsed (its builder's refusal, word for word)."
    return parse


def _compress(text):
    from ..compress import parse
    return parse(text)


def _weights(text):
    from ..compress.weights import parse_weights
    return parse_weights(text)


#: ``--compress``: a wire minizero.compress can build (``topk:0.01``, ``int8:block=64``); ``--quantized-weights``:
#: a quantized codec the weights can travel as (``int8``, ``int4:block=64``).
compress_spec, weights_spec = _checked(_compress, "--compress"), _checked(_weights, "--quantized-weights")
compress_spec.choices = ("none", "fp16", "bf16", "int8", "int4", "fp8", "topk:F", "sign", "powersgd:rank=R")  # for --help
weights_spec.choices = ("none", "int8", "int4")


# ---------------------------------------------------------------------- the options several stages share
#: Bucket caps the suite draws: one parameter per bucket, a few buckets, one bucket (25 MiB: torch's default).
BUCKET_MB_DRAWN = (1e-9, 2e-4, 1e-3, 25.0)

BUCKET_MB = Option("bucket_mb", 25.0, "bucket size in MiB (torch DDP's bucket_cap_mb: 25)", positive_float,
                   draw=lambda d: BUCKET_MB_DRAWN)
COMPRESS = Option("compress", None, "the gradients' wire: fp16, bf16, int8, int4, topk:FRACTION, sign or "
                  "powersgd:rank=R (minizero.compress)", compress_spec, into=("wire", "compress"))
ERROR_FEEDBACK = Option("error_feedback", False, "carry the compression error to the next step", None,
                        into=("wire", "error_feedback"))
FIND_UNUSED_PARAMETERS = Option(
    "find_unused_parameters", False, "agree every step on which parameters got a gradient anywhere (torch's name)",
    None, draw=lambda d: (True,) if d.unused_parameters else ())  # else every parameter must get a gradient
PRECISION = Option("precision", "fp32", "fp32, or bf16/fp16 compute with fp32 master weights (minizero.parts.precision)",
                   choice("fp32", "bf16", "fp16"))

#: ZeRO-1's overlap (DeepSpeed stage 1's ``overlap_comm``).  Not drawn by the whole suite (the zero1 lab's
#: post_backward is the paper's, after backward): tests/test_zero1_overlap.py draws it.
OVERLAP = Option("overlap", False, "reduce-scatter each bucket during backward, the full gradients kept "
                 "(DeepSpeed stage 1's overlap_comm); off: after backward, as the paper", None)

#: ZeRO-3's (and its kin's) units gathered ahead of use.
PREFETCH = Option("prefetch", 1, "units whose all-gather starts ahead of use", natural_int, draw=lambda d: (0, 1, 2))

#: ZeRO-2's and -3's bound on packed buckets in flight during backward (FSDP2's
#: ``set_reduce_scatter_max_input_buffers``).  Not drawn by the whole suite, whose draws it would shift:
#: tests/test_reduce_scatter_buffers.py draws it.
REDUCE_SCATTER_BUFFERS = Option("reduce_scatter_buffers", MAX_IN_FLIGHT, "packed buckets whose reduce-scatter may be in flight "
                                "before backward packs the next (FSDP2's set_reduce_scatter_max_input_buffers: 1; "
                                "2 hides a slow wire's wait behind one more bucket of memory)", positive_int)


def check_reduce_scatter_buffers(buffers) -> None:
    """Before anything is sharded: a count of buffers, as FSDP2's setter takes (a type error, then a value error)."""
    if type(buffers) is not int:
        raise TypeError(f"reduce_scatter_buffers must be a whole number (an int), got {buffers!r} of type "
                        f"{type(buffers).__name__} (FSDP2's default is {MAX_IN_FLIGHT})")
    if buffers < 1:
        raise ValueError(f"reduce_scatter_buffers must be >= 1 packed bucket in flight, got {buffers} (FSDP2's "
                         f"default is {MAX_IN_FLIGHT}: backward waits for the one before)")

#: What a stage that averages gradients takes, in its constructor's order after bucket_mb.
WIRE_AND_USE = (COMPRESS, ERROR_FEEDBACK, FIND_UNUSED_PARAMETERS, PRECISION)

#: The ZeRO stages' last option.  Not drawn by the whole suite, whose draws it would shift:
#: tests/test_offload.py draws it in every example of every ZeRO stage.
OFFLOAD_OPTIMIZER = Option("offload_optimizer", False, "keep this rank's fp32 masters and optimizer states in "
                           "host memory and step there (ZeRO-Offload, minizero.parts.offload)", None,
                           into=("offload", "optimizer"))


def option_names(stage: type) -> list[str]:
    """The keywords of ``stage``'s declared options (``Stage.option_names`` is this)."""
    return [option.name for option in stage.options]


def constructor_keywords(stage: type, options: dict) -> dict:
    """``options`` -- the declared ones by name, as the command line gives them -- as ``stage``'s constructor
    takes them: each option declared ``into`` a policy becomes a field of that policy's object.  A policy given
    whole (``wire=WirePolicy(...)``) is passed on as it is, but not beside its own fields."""
    keywords, policies = {}, {}
    for option in stage.options:
        if option.name not in options:
            continue
        if option.into is None:
            keywords[option.name] = options[option.name]
        else:
            policies.setdefault(option.into[0], {})[option.into[1]] = options[option.name]
    for policy, given in policies.items():
        if policy in options:
            raise TypeError(f"stage {stage.name!r}: give {policy}= or its fields {sorted(given)}, not both")
        keywords[policy] = POLICIES[policy](**given)
    return {**keywords, **{p: options[p] for p in POLICIES if p in options}}


def _constructor_defaults(stage: type) -> dict:
    """What the constructor should read, from the declarations: each plain option with its default, each policy
    with its class built from its fields' declared defaults."""
    defaults, policies = {}, {}
    for option in stage.options:
        if option.into is None:
            defaults[option.name] = option.default
        else:
            policies.setdefault(option.into[0], {})[option.into[1]] = option.default
    for policy, given in policies.items():
        whole = {f.name for f in fields(POLICIES[policy])}
        defaults[policy] = POLICIES[policy](**given) if set(given) == whole else f"all of {sorted(whole)}"
    return defaults


def check_declared(stage: type) -> None:
    """A stage's declared options are its constructor's keywords, with the same defaults: the declaration is
    what every command reads, the constructor what runs -- they must not drift apart.  Options declared ``into``
    a policy stand for that policy's keyword, every field declared.  A constructor that passes ``**options`` on
    to its parent's takes the parent's too."""
    parameters = [p for p in inspect.signature(stage.__init__).parameters.values()
                  if p.name not in ("self", "module", "optimizer", "comm")]
    passes_on = any(p.kind in (p.VAR_KEYWORD, p.VAR_POSITIONAL) for p in parameters)
    declared = _constructor_defaults(stage)
    actual = {p.name: p.default for p in parameters if p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)}
    wrong = [name for name, default in actual.items() if name not in declared or declared[name] != default]
    undeclared_or_missing = wrong or (not passes_on and sorted(declared) != sorted(actual))
    if undeclared_or_missing:
        raise TypeError(f"stage {stage.name!r} declares options {declared} but its constructor takes {actual}: "
                        f"list every keyword of __init__ (after module, optimizer, comm) in {stage.__name__}.options, "
                        f"with its default (a policy's by its fields: {', '.join(POLICIES)})")

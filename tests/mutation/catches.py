"""The checks a mutant names as its catch: ``catch(pools)`` passes on the real code and must fail -- by an
assertion, or an error the mutant's entry expects -- while the mutant is in place."""
from __future__ import annotations

import importlib
import itertools
import tempfile
from pathlib import Path
from typing import Callable

import torch
from hypothesis import HealthCheck, Phase, given, settings

from minizero.comm import ReduceOp
from tests.equivalence import experiments, run_and_check


def property_catch(stage: str, examples: int = 40, **draw) -> Callable:
    """The equivalence property of ``stage``, generate phase only (no shrinking: we only need a failure)."""
    def catch(pools):
        @settings(max_examples=examples, derandomize=True, database=None, deadline=None, phases=[Phase.generate],
                  suppress_health_check=list(HealthCheck))
        @given(drawn=experiments(stage, **{"world_sizes": (2, 3, 4), "max_accum": 4, **draw}))
        def equivalence(drawn):
            run_and_check(pools, *drawn)
        equivalence()
    return catch


def comm_catch(pools):
    """The collectives' check on a grid -- every kind, op, dtype and backend, N = 2..4, an uneven
    length -- rather than a random draw, so no combination is left to chance."""
    from tests.test_comm import DTYPES, test_collectives_match_math_and_ledger

    inner = test_collectives_match_math_and_ledger.hypothesis.inner_test
    kinds = ["all_reduce", "reduce_scatter", "all_gather", "broadcast", "root_all_reduce"]
    for world_size, kind, op, dtype, backend in itertools.product(
            (2, 3, 4), kinds, list(ReduceOp), (torch.float32, torch.float64, DTYPES[0]), ("ring", "native")):
        inner(pools, world_size, (kind, 7, dtype, op, backend, 1, world_size - 1))


CATCH_MODULES = {"test_comm", "test_zero3"}  # every module a catch runs code from


def test_catch(module: str, name: str, *args) -> Callable:
    """An ordinary test of the suite, called with ``pools`` if it takes it."""
    CATCH_MODULES.add(module)

    def catch(pools):
        fn = getattr(importlib.import_module(f"tests.{module}"), name)
        return fn(pools, *args) if "pools" in fn.__code__.co_varnames[:fn.__code__.co_argcount] else fn(*args)
    return catch


def dropout_resume_catch(stage: str) -> Callable:
    """The dropout resume test of ``stage``, in a directory of its own (the test takes pytest's tmp_path)."""
    CATCH_MODULES.add("test_clip_and_dropout_resume")

    def catch(pools):
        from tests.test_clip_and_dropout_resume import test_resume_with_dropout_is_bit_exact

        with tempfile.TemporaryDirectory() as directory:
            test_resume_with_dropout_is_bit_exact(pools, Path(directory), stage)
    return catch


def tied_weight_owner_catch(pools) -> None:
    """test_zero3's ``test_tied_parameter_goes_to_the_root``, calling ``assign_parameters`` through its module
    (the test holds the function it imported, before any mutant).  Owned by a unit, the tied weight is freed
    after that unit's forward and the other unit's use fails on an empty tensor -- a crash, so the catch is
    this assertion on who owns it."""
    from minizero.course.harness.models import TinyGPT
    from minizero.parts import unit_plan as units
    from tests.test_zero3 import GPT_UNITS

    gpt = TinyGPT()
    owners = {n: i for i, params in enumerate(units.assign_parameters(gpt, units.resolve_units(gpt, GPT_UNITS)))
              for n, _ in params}
    assert owners["token_embedding.weight"] == 0, \
        f"the tied embedding/head weight belongs to unit {owners['token_embedding.weight']}, not the root (0)"


def import_catch_modules() -> None:
    """Import every module a catch runs code from *now*, before any pool forks: a rank that had to import
    one later would do it inside the @given the pool was forked from, and trip hypothesis's nested-given
    health check."""
    for module in sorted(CATCH_MODULES):
        importlib.import_module(f"tests.{module}")

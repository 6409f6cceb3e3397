"""The mutation harness: put a broken function in place, and run the part of the suite that must fail.

A :class:`Mutant` names its target (``"package.module:Class.attr"``), the
broken replacement, and its *catch*: a check that passes on the real code and
must fail while the mutant is in place.  ``conftest.Pools.patched`` applies it
in the test process and in every rank.
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Callable

import torch
from hypothesis import HealthCheck, Phase, given, settings

from minizero.comm import ReduceOp
from tests.equivalence import experiments, run_and_check


@dataclass
class Mutant:
    target: str  # "package.module:Name.attribute"
    replacement: Callable
    catch: Callable  # catch(pools) must raise while the mutant is in place
    cost: bool = False  # right in value, wrong in bytes, memory or overlap


def _resolve(target: str):
    module, path = target.split(":")
    owner = importlib.import_module(module)
    *parents, attr = path.split(".")
    for name in parents:
        owner = getattr(owner, name)
    if not hasattr(owner, attr):
        raise AttributeError(f"mutant target {target} does not exist")  # a harness error, never "caught"
    return owner, attr


def patch(mutant: Mutant):
    """Put the mutant in place; returns what it replaced."""
    owner, attr = _resolve(mutant.target)
    original = owner.__dict__[attr] if isinstance(owner, type) else getattr(owner, attr)
    setattr(owner, attr, mutant.replacement)
    return original


def unpatch(mutant: Mutant, original) -> None:
    owner, attr = _resolve(mutant.target)
    setattr(owner, attr, original)


# ------------------------------------------------------------------------------- catches
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
    import itertools

    from tests.test_comm import DTYPES, test_collectives_match_math_and_ledger

    inner = test_collectives_match_math_and_ledger.hypothesis.inner_test
    kinds = ["all_reduce", "reduce_scatter", "all_gather", "broadcast", "root_all_reduce"]
    for world_size, kind, op, dtype, backend in itertools.product(
            (2, 3, 4), kinds, list(ReduceOp), (torch.float32, torch.float64, DTYPES[0]), ("ring", "native")):
        inner(pools, world_size, (kind, 7, dtype, op, backend, 1, world_size - 1))


CATCH_MODULES = {"test_comm"}  # every module a catch runs code from


def test_catch(module: str, name: str, *args) -> Callable:
    """An ordinary test of the suite, called with ``pools`` if it takes it."""
    CATCH_MODULES.add(module)

    def catch(pools):
        fn = getattr(importlib.import_module(f"tests.{module}"), name)
        return fn(pools, *args) if "pools" in fn.__code__.co_varnames[:fn.__code__.co_argcount] else fn(*args)
    return catch


def import_catch_modules() -> None:
    """Import every module a catch runs code from *now*, before any pool forks: a rank that had to import
    one later would do it inside the @given the pool was forked from, and trip hypothesis's nested-given
    health check."""
    for module in sorted(CATCH_MODULES):
        importlib.import_module(f"tests.{module}")

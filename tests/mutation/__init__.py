"""The mutation harness: put a broken function in place, run the part of the suite that must fail, and judge
*how* it failed.

A :class:`Mutant` names its target (``"package.module:Class.attr"``), the broken replacement, and its *catch*:
a check that passes on the real code and must fail while the mutant is in place.  ``conftest.Pools.patched``
applies it in the test process and in every rank; :func:`try_catch` runs the catch and says whether it caught
the mutant.

Caught means a check said no: an ``AssertionError`` (a test's ``assert``, hypothesis re-raising one, a
``pytest.raises`` whose pattern did not match) or pytest's ``Failed`` (a ``pytest.raises`` whose error never
came) -- raised here or on a rank -- or a named error that the mutant's entry declares as its detection
(:class:`Expected`: a fingerprint mismatch, a stall verdict, the overflow guard).  Anything else -- a
``TypeError`` of a stale signature, an ``AttributeError``, a rank that aborted -- is a *crash*: the mutant
broke the code so badly that nothing was checked, and a crash is not a catch.

The rest of the package: :mod:`.catches` (the checks a mutant names), :mod:`.broken_comm`,
:mod:`.broken_training` and :mod:`.broken_clip_and_state` (the broken copies), :mod:`.register` (the table of
mutants, and the broken *stages* of :mod:`minizero.course.labs.mistakes`).
"""
from __future__ import annotations

import builtins
import importlib
import re
import traceback
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable

import pytest
from hypothesis.errors import Flaky

from minizero.course.harness.rank_verdict import raised
from minizero.run.launch import RankError

#: What a check raises when it says no: ``assert`` and pytest's ``Failed`` (``pytest.fail``, and
#: ``pytest.raises`` when the error did not come).
ASSERTIONS = (AssertionError, pytest.fail.Exception)


@dataclass(frozen=True)
class Expected:
    """A named error that is the detection, not a crash: ``error`` (a class; a rank's is matched by its name
    and, where it can be imported, its subclasses), ``match`` a regular expression its message must contain,
    ``why`` why this error, and not an assertion, is how the suite notices the bug."""
    error: type[BaseException]
    match: str = ""
    why: str = ""


#: The watchdog's verdict on a collective nobody finishes: the detection when a test's claim is "no stall".
STALL = Expected(RankError, r"^stalled: ", "the watchdog stopped a run that must complete")


@dataclass
class Mutant:
    target: str  # "package.module:Name.attribute"
    replacement: Callable
    catch: Callable  # catch(pools) must fail, by assertion or an expected error, while the mutant is in place
    cost: bool = False  # right in value, wrong in bytes, memory or overlap
    expect: tuple[Expected, ...] = ()  # named errors that count as caught (see Expected)


# ------------------------------------------------------------------------------- putting it in place
_REPLACED: dict[int, object] = {}  # id(replacement) -> what it replaced, while it is in place


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
    _REPLACED[id(mutant.replacement)] = original
    return original


def unpatch(mutant: Mutant, original) -> None:
    owner, attr = _resolve(mutant.target)
    setattr(owner, attr, original)
    _REPLACED.pop(id(mutant.replacement), None)


def original_of(replacement: Callable):
    """What ``replacement`` stands in for, while it is in place: a broken copy that changes one thing and calls
    the real code for the rest looks it up here, at call time, rather than holding it from import time."""
    return _REPLACED[id(replacement)]


@contextmanager
def patched(mutant: Mutant):
    """The mutant in place in this process only (the pools' ranks: ``conftest.Pools.patched``)."""
    original = patch(mutant)
    try:
        yield
    finally:
        unpatch(mutant, original)


# ------------------------------------------------------------------------------- judging a failure
@dataclass
class Failure:
    """One exception, unwrapped: a rank's (out of its RankError) or this process's."""
    name: str  # the class as Python prints it: "AssertionError", "minizero.comm.fingerprint.CollectiveMismatch"
    error: type | None  # the class, where it can be imported
    message: str
    where: str  # "this process", "rank 2", "the launcher" (a RankError of its own: a stall, a death)
    text: str  # the traceback

    def is_a(self, cls: type) -> bool:
        if self.error is not None:
            return issubclass(self.error, cls)
        return self.name.rsplit(".", 1)[-1] == cls.__name__

    def line(self) -> str:
        """Where the exception was raised: the last frame's file and line."""
        frames = re.findall(r'File "([^"]+)", line (\d+)', self.text)
        if not frames:
            return self.where
        path, number = frames[-1]
        inside = re.fullmatch(r".*/((?:site-packages|minizero|tests)/.*)", path)  # from the root of the project
        return f"{self.where}, {inside.group(1) if inside else path}:{number}"


def _class_named(name: str) -> type | None:
    module, _, attr = name.rpartition(".")
    try:
        found = getattr(importlib.import_module(module) if module else builtins, attr)
    except (ImportError, AttributeError, ValueError):
        return None
    return found if isinstance(found, type) and issubclass(found, BaseException) else None


def unwrap(error: BaseException) -> Failure:
    """A RankError that carries a rank's traceback stands for the rank's own exception (its last line:
    ``module.Class: message``); one without (a stall, a death) is the launcher's own verdict."""
    if isinstance(error, RankError) and error.remote_traceback:
        last = raised(error.remote_traceback)
        first, _, more = last.partition("\n")
        name, _, message = first.partition(":")
        if not re.fullmatch(r"[\w.]+", name.strip()):  # not an exception's name: the whole text is the message
            name, message, more = "unknown", last, ""
        return Failure(name.strip(), _class_named(name.strip()), f"{message}\n{more}".strip(), f"rank {error.rank}",
                       error.remote_traceback)
    where = "the launcher" if isinstance(error, RankError) else "this process"
    cls = type(error)
    name = cls.__qualname__ if cls.__module__ == "builtins" else f"{cls.__module__}.{cls.__qualname__}"
    return Failure(name, cls, str(error), where, "".join(traceback.format_exception(error)))


def _leaves(error: BaseException) -> list[BaseException]:
    """An exception group's exceptions, nested groups opened (hypothesis reports distinct bugs as a group)."""
    inner = getattr(error, "exceptions", None)  # a BaseExceptionGroup (Python 3.11, or the 3.10 backport)
    if isinstance(inner, tuple) and not isinstance(error, Flaky):
        return [leaf for one in inner for leaf in _leaves(one)]
    return [error]


@dataclass
class Verdict:
    caught: bool
    how: str  # one line: "assertion (this process, tests/test_comm.py:88)", "crashed, not caught: ..."
    detail: str = ""  # the traceback(s) of what was not a catch

    def report(self) -> str:
        return f"{self.how}\n{self.detail}".rstrip()


def _judge_one(failure: Failure, expect: tuple[Expected, ...]) -> tuple[bool, str]:
    if failure.is_a(Flaky):
        return False, f"flaky, not caught: the failure did not repeat ({failure.line()})"
    if any(failure.is_a(cls) for cls in ASSERTIONS):
        return True, f"assertion ({failure.line()})"
    for expected in expect:
        if failure.is_a(expected.error) and re.search(expected.match, failure.message):
            return True, f"expected {expected.error.__name__} ({failure.line()})"
    return False, (f"crashed, not caught: {failure.name} ({failure.line()}) is neither an assertion nor an "
                   f"error this mutant's entry expects: {failure.message[:300]}")


def judge(error: BaseException | None, expect: tuple[Expected, ...] = ()) -> Verdict:
    """Did the catch catch the mutant?  ``error``: what the catch raised (None: it passed).  Several failures at
    once (an exception group) are a catch only if every one of them is."""
    if error is None:
        return Verdict(False, "survived: the catch passed with the mutant in place")
    leaves = _leaves(error)
    failures = [unwrap(leaf) for leaf in leaves]
    judged = [_judge_one(f, expect) for f in failures]
    if all(ok for ok, _ in judged):
        return Verdict(True, "; ".join(how for _, how in judged))
    texts = [f.text for f, (ok, _) in zip(failures, judged, strict=True) if not ok]
    if leaves != [error]:  # a group: its own traceback shows where each of its exceptions was raised
        texts.append("".join(traceback.format_exception(error)))
    return Verdict(False, "; ".join(how for ok, how in judged if not ok), "\n".join(texts))


def try_catch(catch: Callable, pools, expect: tuple[Expected, ...] = ()) -> Verdict:
    """Run ``catch(pools)`` (the mutant already in place) and judge how it ended."""
    try:
        catch(pools)
    except KeyboardInterrupt:
        raise
    except BaseException as error:  # noqa: BLE001 -- pytest's Failed and Skipped are BaseExceptions: judged too
        return judge(error, expect)
    return judge(None, expect)

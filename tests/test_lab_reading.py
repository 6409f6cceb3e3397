"""A learner reads every module a lab's skeleton names without meeting an answer (issue 45): a skeleton sends its
reader to the package for helpers -- flat buffers, the shard layout, a formula -- and a helper that lived beside a
lab's finished method would show the answer to whoever went to read it.  The answers are the package's methods
each lab's base takes out (:func:`minizero.course.labs.given.without` keeps them in ``__answers__``)."""
from __future__ import annotations

import importlib.util
import inspect
import re
from pathlib import Path

import pytest

from minizero.course.labs import given
from minizero.course.labs.skeletons import contract, guided

SKELETONS = sorted(Path(contract.__file__).parent.glob("[!_]*.py")) + sorted(Path(guided.__file__).parent.glob("[!_]*.py"))


def answers_by_file() -> dict[str, list[str]]:
    """Each file that defines a lab's answer, and which answers."""
    found: dict[str, list[str]] = {}
    for base in {cls for value in vars(given).values() if inspect.isclass(value) for cls in value.__mro__}:
        for fn in vars(base).get("__answers__", {}).values():
            fn = inspect.unwrap(fn)
            found.setdefault(str(Path(inspect.getsourcefile(fn)).resolve()), []).append(fn.__qualname__)
    return found


def named_modules(text: str) -> set[str]:
    """The modules a skeleton's text names: the longest importable prefix of each ``minizero.a.b.c``."""
    named = set()
    for dotted in re.findall(r"\bminizero(?:\.\w+)+", text):
        parts = dotted.split(".")
        for end in range(len(parts), 1, -1):
            try:
                spec = importlib.util.find_spec(".".join(parts[:end]))
            except (ImportError, AttributeError):  # a class or a function: not a module, look at its parent
                continue
            if spec is not None and spec.origin:
                named.add(".".join(parts[:end]))
                break
    return named


def test_the_answers_are_found_where_they_are_written():
    """The search can fail: the ring's and DDP's answers are in the files that define them."""
    found = answers_by_file()
    ring = str(Path(inspect.getsourcefile(inspect.unwrap(given.Ring.__answers__["_ring_reduce_scatter"]))).resolve())
    assert ring.endswith("comm/ring.py") and "RingComm._ring_reduce_scatter" in found[ring]
    assert any(q == "DDP.post_backward" for qs in found.values() for q in qs)
    assert named_modules("see ``minizero.comm.ring.RingComm`` and minizero.parts.flat's pack") == {
        "minizero.comm.ring", "minizero.parts.flat"}


@pytest.mark.parametrize("skeleton", SKELETONS, ids=lambda p: f"{p.parent.name}/{p.stem}")
def test_no_module_a_skeleton_names_holds_an_answer(skeleton):
    answers = answers_by_file()
    shown = {}
    for module in named_modules(skeleton.read_text()):
        origin = str(Path(importlib.util.find_spec(module).origin).resolve())
        if origin in answers:
            shown[module] = answers[origin]
    assert not shown, (f"{skeleton.parent.name}/{skeleton.name} sends its reader to modules that hold a lab's answer: "
                       f"{shown} -- move the helper to a module of its own, or say what it does in the skeleton")

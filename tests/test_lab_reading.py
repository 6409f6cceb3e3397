"""A learner reads every module a lab's skeleton names without meeting an answer (issue 45): a skeleton sends its
reader to the package for helpers -- flat buffers, the shard layout, a formula -- and a helper that lived beside a
lab's finished method would show the answer to whoever went to read it.  The answers are the package's methods
each lab's base takes out (:func:`minizero.course.labs.given.without` keeps them in ``__answers__``)."""
from __future__ import annotations

import importlib
import importlib.util
import inspect
import re
from pathlib import Path

import pytest

from minizero.course.labs import LABS, given
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


def named_helpers(skeleton: Path) -> dict[str, tuple[str, object]]:
    """The methods a skeleton sends its reader to by name (``self.tag(...)``, ``start_gather``), each with the file
    that defines it: the first class in its own classes' bases that has it -- not the lab's methods (theirs to
    write) and not the lab's base's blanks: ``{"Class.method": (file, code)}``."""
    module = importlib.import_module(f"minizero.course.labs.skeletons.{skeleton.parent.name}.{skeleton.stem}")
    text = skeleton.read_text()
    names = set(re.findall(r"``(?:self\.)?(\w+)", text)) | set(re.findall(r"\bself\.(\w+)", text))
    found = {}
    for cls in [c for c in vars(module).values() if inspect.isclass(c) and c.__module__ == module.__name__]:
        for name in names - set(vars(cls)):
            owner = next((base for base in cls.__mro__[1:] if name in vars(base)), None)
            if owner is None or owner.__module__ == given.__name__ or not callable(vars(owner)[name]):
                continue
            fn = inspect.unwrap(vars(owner)[name])
            found[f"{owner.__qualname__}.{name}"] = (str(Path(inspect.getsourcefile(fn)).resolve()), fn.__code__)
    return found


def answers_by_lab() -> dict[str, set[tuple[str, object]]]:
    """Each lab's answers: ``(file, code)`` of the package's method for each method the lab asks for."""
    found: dict[str, set[tuple[str, object]]] = {}
    for name, lab in LABS.items():
        module = importlib.import_module(f"minizero.course.labs.skeletons.contract.{name.replace('-', '_')}")
        for todo in lab.todo:
            owner, method = todo.split(".")
            answer = next(vars(base)["__answers__"][method] for base in getattr(module, owner).__mro__
                          if method in vars(base).get("__answers__", {}))
            fn = inspect.unwrap(answer)
            found.setdefault(name, set()).add((str(Path(inspect.getsourcefile(fn)).resolve()), fn.__code__))
    return found


def course_order(lab: str) -> tuple[int, int]:
    """Where a lab comes in the course: its lesson's number, then its place in the registry."""
    return int(Path(LABS[lab].lesson).name[:2]), list(LABS).index(lab)


@pytest.mark.parametrize("skeleton", SKELETONS, ids=lambda p: f"{p.parent.name}/{p.stem}")
def test_no_helper_a_skeleton_names_sits_beside_a_later_labs_answer(skeleton):
    """A skeleton names helpers by method as well as by module -- ``self.tag(...)``, ``start_gather`` -- and each
    must read without meeting the answer of a lab still ahead in the course (the base's ``tag``, once beside
    lesson 6's ``no_sync``, read by the labs of lessons 3 and 4).  Its own lab's file is the stage it completes
    (the answer, read after the lab), an earlier lab's answer is already the learner's, and a helper that *is* a
    later lab's answer is given to this one whole."""
    lab = next(name for name in LABS if name.replace("-", "_") == skeleton.stem)
    later = {other: answers for other, answers in answers_by_lab().items()
             if course_order(other) > course_order(lab)}
    shown = {helper: sorted(c.co_qualname for f, c in answers if f == file)
             for helper, (file, code) in named_helpers(skeleton).items()
             for answers in later.values() if any(f == file and c is not code for f, c in answers)}
    assert not shown, (f"{skeleton.parent.name}/{skeleton.name} names helpers written beside a later lab's answer: "
                       f"{shown} -- move the helper to a module of its own, or say what it does in the skeleton")

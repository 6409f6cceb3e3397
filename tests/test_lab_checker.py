"""The checker cannot be passed by accident: whatever part of a correct file a learner deletes, the check fails and
names the method -- the package's finished stage never stands in for theirs (issue 26's first "Done when")."""
from __future__ import annotations

import ast
import importlib
import re
from pathlib import Path

import pytest

from minizero.course.labs import LABS, LEVELS, check, given

SOLUTIONS = Path(__file__).parent / "lab_solutions"


def quiet(_):
    pass


def _members(path: Path) -> list[tuple[str, str]]:
    """(class, member) of every method and class attribute the file's classes define."""
    tree = ast.parse(path.read_text())
    return [(c.name, m.name if isinstance(m, ast.FunctionDef) else ast.unparse(m.targets[0]))
            for c in tree.body if isinstance(c, ast.ClassDef)
            for m in c.body if isinstance(m, (ast.FunctionDef, ast.Assign))]


def _without(path: Path, owner: str, member: str) -> str:
    """The file's source with ``owner.member`` deleted (a class left empty gets ``pass``)."""
    tree = ast.parse(path.read_text())
    for c in tree.body:
        if isinstance(c, ast.ClassDef) and c.name == owner:
            c.body = [m for m in c.body if not (
                (isinstance(m, ast.FunctionDef) and m.name == member)
                or (isinstance(m, ast.Assign) and ast.unparse(m.targets[0]) == member))] or [ast.Pass()]
    return ast.unparse(tree)


@pytest.mark.parametrize("lab", list(LABS))
@pytest.mark.parametrize("level", LEVELS)
def test_a_skeleton_holds_only_the_learners_methods_and_pointers_to_their_classes(lab, level):
    """What a skeleton's classes define besides the lab's methods is only ``unit_class = Unit``-style pointers from
    the stage to the learner's other class -- and the base's own pointer (:mod:`minizero.course.labs.given`) leads to a
    class whose lab methods raise: deleting it cannot bring back the package's answer.  (A given method restated
    in a skeleton would be the package's behaviour by another name: deleting it would change nothing a check can
    see, so there are none.)"""
    spec = LABS[lab]
    module = importlib.import_module(f"minizero.course.labs.skeletons.{level}.{lab.replace('-', '_')}")
    for owner, member in _members(spec.skeleton_at(level)):
        if f"{owner}.{member}" in spec.todo:
            continue
        assert member.endswith("_class"), f"{level}/{lab}: {owner}.{member} is neither a lab method nor a pointer"
        base = getattr(module, owner).__mro__[1]
        assert base.__module__ == given.__name__ and getattr(base, member).__module__ == given.__name__, \
            (lab, owner, member, getattr(base, member))


def _variants():
    for lab, spec in LABS.items():
        for level in LEVELS:
            path = SOLUTIONS / level / f"{lab.replace('-', '_')}.py"
            for owner, member in _members(path):
                yield pytest.param(lab, path, owner, member, id=f"{level}-{lab}-{owner}.{member}")


@pytest.mark.parametrize("lab, path, owner, member", list(_variants()))
def test_an_answer_key_with_any_part_deleted_fails_naming_a_method(pools, tmp_path, lab, path, owner, member):
    """A lab method deleted from a correct file leaves the skeleton's, which raises: the check fails naming it.  A
    pointer deleted (``unit_class = Unit``) leaves the base's, whose methods raise: the check fails naming them.
    A helper of the learner's own, deleted, is named by what raises where it was called.  A pointer deleted fails
    the first check, "your methods are what runs" -- the file defines every method, none of which runs -- and
    says which attribute to set; it used to pass it, and be told "your file does not define" what it defines."""
    variant = tmp_path / f"{lab.replace('-', '_')}_without_{member}.py"
    variant.write_text(_without(path, owner, member))
    report = check(lab, impl=str(variant), examples=2, pools=pools, out=quiet, shrink_s=0)
    assert not report.ok, f"{variant.name} passed: the deleted {owner}.{member} was not needed, or was replaced"
    todo = f"{owner}.{member}"
    if todo in LABS[lab].todo:
        assert todo in report.why, (report.failed, report.why)
    elif member.endswith("_class"):  # the base's pointer leads to its raising class: the first check says so, and how
        assert report.failed == "your methods are what runs", (todo, report.failed, report.why)  # not a PASS (issue 45)
        assert [t for t in LABS[lab].todo if t in report.why] and f"set {member} = " in report.why, (todo, report.why)
    else:  # a helper of the learner's own: what raised names it
        assert member in report.why, (todo, report.failed, report.why)



@pytest.mark.parametrize("slip, said", [
    # every rank's sizes are gathered before each step: the pair that disagrees is named, on every rank
    ("all_gather_sends_its_own_chunk", r"rank \d raised RuntimeError: rank \d: all-gather step \d: rank \d sends \d "
                                       r"elements and rank \d receives into a chunk of \d -- each step's send must be"),
    # one rank combines chunks of two sizes and raises alone: its error, not its waiting peers' stall, is the verdict
    ("receives_the_wrong_chunk", r"rank 3 raised RuntimeError: .*shape.*\n    at \S+receives_the_wrong_"
                                 r"chunk.py:\d+ in _ring_reduce_scatter.*\(rank 3 raised alone: the other ranks")])
def test_a_ring_step_whose_send_and_receive_differ_in_size_is_named(pools, slip, said):
    """Chunks of 1, 1, 0 and 0 elements on four ranks: a slip that sends a chunk into a receive of another size was
    gloo aborting the receiver or a stalled ring, saying neither which step nor which chunk."""
    from minizero.course.labs.catalogue import LABS
    from minizero.course.labs.check import Checker
    from minizero.course.labs.failed import Failed
    from minizero.course.labs.loading import Impl
    from minizero.course.labs.ranks import collectives_round
    path = str(Path(__file__).parent / "lab_mistakes" / "ring" / f"{slip}.py")
    checker = Checker(LABS["ring"], Impl.of(LABS["ring"], path), pools)
    with pytest.raises(Failed) as failed:
        checker.on_ranks(4, collectives_round, checker.impl, 2, "float64", 0)
    assert re.search(said, failed.value.why, re.S), failed.value.why

"""The labs are tested at both levels (contract, guided): every blank skeleton fails, naming the property, the
smallest case and the method to write; every answer key -- the package's own stage, and a file written from each
level's skeleton alone -- passes every property; a known mistake is named.

Every test over the labs is parametrised over ``LABS`` x ``LEVELS``, so a lab added to the catalogue is covered at
once -- and one whose skeleton or answer key at a level is missing fails here, never skips."""
from __future__ import annotations

import ast
import importlib
import inspect
import re
from pathlib import Path

import pytest

from minizero.__main__ import main
from minizero.comm import Comm
from minizero.course.labs import LABS, LEVELS, check, skeleton_path, start
from minizero.course.labs import mistakes as known
from minizero.course.labs.property_table import PROPERTIES

SOLUTIONS = Path(__file__).parent / "lab_solutions"
EVERY_LEVEL = [pytest.param(lab, level, id=f"{lab}-{level}") for lab in LABS for level in LEVELS]


def quiet(_):
    pass


def module_name(lab: str) -> str:
    return lab.replace("-", "_")


def skeleton_of(lab: str, level: str) -> Path:
    path = skeleton_path(lab, level)
    assert path.is_file(), f"lab {lab!r} has no {level} skeleton: write {path} (every lab ships both levels)"
    return path


def answer_key(lab: str, level: str) -> Path:
    """The file written from the ``level`` skeleton alone: ``tests/lab_solutions/<level>/<lab>.py``."""
    path = SOLUTIONS / level / f"{module_name(lab)}.py"
    assert path.is_file(), f"lab {lab!r} has no {level} answer key: write {path} (every lab ships both)"
    return path


@pytest.mark.parametrize("lab, level", EVERY_LEVEL)
def test_a_blank_skeleton_fails_naming_the_property_the_case_and_what_to_write(pools, lab, level):
    report = check(lab, impl=skeleton_of(lab, level), examples=5, pools=pools, out=quiet)
    assert not report.ok
    assert report.failed == PROPERTIES[LABS[lab].properties[0]][0], report  # the first property after "yours"
    assert report.case.startswith("world size 1"), report.case  # shrunk to the smallest world
    assert any(f"raised NotImplementedError: write {method}" in report.why for method in LABS[lab].todo), report.why


@pytest.mark.parametrize("lab, level", EVERY_LEVEL)
def test_a_skeleton_builds_on_a_base_without_the_answer(lab, level):
    """No renaming layer: each method the learner writes is the package's method of the same name, so the lab reads
    as the stage does -- but the skeleton's base (``minizero.course.labs.given``) has it taken out: the package's class with
    that method raising, naming itself.  A learner who deletes it gets that error, not the answer.  The skeleton's own
    method is blank too -- a docstring and the raise, nothing of the answer."""
    skeleton_of(lab, level)
    skeleton = importlib.import_module(f"minizero.course.labs.skeletons.{level}.{module_name(lab)}")
    for todo in LABS[lab].todo:
        cls_name, method = todo.split(".")
        cls = getattr(skeleton, cls_name)
        given = cls.__mro__[1]
        package = next(c for c in cls.__mro__ if not c.__module__.startswith("minizero.course.labs"))
        assert given.__module__ == "minizero.course.labs.given", given
        assert method in vars(cls), f"{todo}: the {level} skeleton does not define it"
        assert any(method in vars(c) for c in package.__mro__ if c is not object), \
            f"{todo}: not a method of the package's {package.__name__}: the skeleton renames it"
        source = inspect.getsource(vars(cls)[method])
        assert f'NotImplementedError("write {todo}' in source, todo
        body = ast.parse(inspect.cleandoc("\n" + source)).body[0].body
        kinds = [type(node.value if isinstance(node, ast.Expr) else node).__name__ for node in body]
        assert kinds in (["Constant", "Raise"], ["Constant", "Raise", "Yield"]), \
            f"{todo} in the {level} skeleton is not blank (a docstring, the raise): {kinds}"
        with pytest.raises(NotImplementedError, match=f"write {todo} "):
            getattr(given, method)(None)


#: A collective called with its arguments: what the guided level no longer dictates, and the contract never names.
DICTATED_CALL = re.compile(r"comm\.(all_reduce|reduce_scatter|all_gather|broadcast)\(\w")


@pytest.mark.parametrize("lab, level", EVERY_LEVEL)
def test_a_skeleton_says_how_to_check_it_and_dictates_no_call(lab, level):
    text = skeleton_of(lab, level).read_text()
    assert f"python -m minizero check {lab} --impl THIS_FILE" in text
    assert not DICTATED_CALL.search(text), f"the {level} skeleton of {lab} dictates a call: {DICTATED_CALL.search(text)[0]}"


@pytest.mark.parametrize("lab", ["ddp", "ring"])
def test_the_answer_key_passes_every_property(pools, lab):
    """``check LAB`` without ``--impl`` judges the package's own class: a stage's and a backend's here.  Every lab's
    properties are shown to pass correct code by its two solutions (below), and the package's stages are proven
    by the suite itself; lesson 12 checks the reshard lab's answer key."""
    report = check(lab, examples=3, pools=pools, out=quiet)
    assert report.ok, (report.failed, report.why, report.case)
    assert len(report.passed) == 1 + len(LABS[lab].properties)  # "your methods are what runs" first


@pytest.mark.parametrize("lab, level", EVERY_LEVEL)
def test_a_skeleton_filled_in_from_its_level_alone_passes(pools, lab, level):
    """Each level is enough: ``tests/lab_solutions/guided/`` follows the guided skeleton's hints line by line;
    ``tests/lab_solutions/contract/`` was written from the contract alone -- where it was not enough, the contract
    was missing something."""
    solution = answer_key(lab, level)
    assert f"skeletons.{level}" in solution.read_text(), f"{solution} does not build on the {level} skeleton"
    report = check(lab, impl=solution, examples=2, pools=pools, out=quiet)
    assert report.ok, (report.failed, report.why, report.case)


STYLES = sorted((SOLUTIONS / "styles").glob("*.py"))


@pytest.mark.parametrize("solution", STYLES, ids=lambda p: p.stem)
def test_a_correct_solution_in_another_style_passes(pools, solution):
    """``tests/lab_solutions/styles/<lab>__<style>.py``: correct files written otherwise than the answer keys, one
    lab at least each -- a ring with its own step labels, one all-reduce per parameter, a lambda for the deferred
    collective, the base's word for a bucket and a ``functools.partial``, a tree by bit masks, ``no_sync`` as a
    class with ``__enter__``, local SGD summing and dividing, ZeRO-1's shard as a chunk and its flags summed,
    ZeRO-3's buffers by index, the hierarchical mean divided once at the end, PowerSGD with index tensors and
    ``out=``, a reshard through the whole group, the mixed-precision duties in a helper.  No correct style may fail
    (issue 45: a ring labelled "rs" once did)."""
    lab = solution.stem.split("__")[0].replace("_", "-")
    assert lab in LABS, f"{solution.name}: name it <lab>__<style>.py, the lab one of {sorted(LABS)}"
    report = check(lab, impl=solution, examples=3, pools=pools, out=quiet)
    assert report.ok, (report.failed, report.why, report.case)


def test_there_are_solutions_in_other_styles():
    assert {p.stem.split("__")[0].replace("_", "-") for p in STYLES} == set(LABS), STYLES  # one for every lab, at least


EQUIVALENCE, BYTES = "equivalence to single-device training", "bytes sent per step against the formula"
#: What each known mistake fails -- every one a lab compares with: a mistake whose override no longer runs (a
#: lifecycle method renamed under it) would behave as the answer key and pass.
KNOWN = {known.SumInsteadOfMean: EQUIVALENCE, known.SyncsWeights: EQUIVALENCE, known.DropsLastParameter: EQUIVALENCE,
         known.TensorHookDDP: EQUIVALENCE, known.PostHookArgumentAsGradient: EQUIVALENCE,
         known.SyncsEveryMicroBatch: "one all-reduce per optimizer step, whatever K",
         known.FP16HookDivision: "equivalence to a reference applying the same casts",
         known.ShiftedShard: EQUIVALENCE, known.AllReduceThenAllGather: BYTES, known.LastMicroBatchOnly: EQUIVALENCE,
         known.NeverReshards: BYTES, known.StaleAfterBackward: EQUIVALENCE}


@pytest.mark.parametrize("lab, mistake", [(name, m) for name, lab in LABS.items() for m in lab.mistakes if m in KNOWN],
                         ids=lambda x: getattr(x, "name", x))
def test_a_known_mistake_is_named(pools, lab, mistake):
    failing = KNOWN[mistake]
    report = check(lab, impl=mistake, examples=5, pools=pools, out=quiet, shrink_s=0)  # naming needs no shrinking
    assert report.failed == failing and report.mistake == mistake.mistake, report


def test_every_known_mistake_of_every_lab_is_judged_somewhere():
    """A lab's known mistakes are judged above (``KNOWN``) or by the lab's own module, ``tests/test_lab_<name>.py``,
    which imports the module that defines them -- none is left untried."""
    own = {path.stem: path.read_text() for path in Path(__file__).parent.glob("test_lab_*.py")}
    missing = [f"{name}: {m.__name__}" for name, lab in LABS.items() for m in lab.mistakes if m not in KNOWN
               and m.__module__ not in own.get(f"test_lab_{module_name(name)}", "")]
    assert not missing, f"known mistakes no test judges: {missing} (add them to KNOWN, or test them in the lab's module)"


def test_check_command_exits_1_with_the_property_and_the_smallest_case(capsys):
    assert main(["check", "ddp", "--impl", str(skeleton_path("ddp")), "--examples", "3"]) == 1
    out = capsys.readouterr().out
    assert "FAIL  equivalence to single-device training" in out
    assert "smallest failing case: world size 1, K = 1" in out
    assert "NotImplementedError: write DDP.post_backward" in out


def test_lab_command_copies_the_skeleton_at_either_level_and_never_overwrites(tmp_path, capsys):
    target = tmp_path / "mine.py"
    assert main(["lab", "zero2", str(target)]) == 0
    assert target.read_text() == skeleton_path("zero2", "contract").read_text()  # the contract by default
    assert "contract level" in capsys.readouterr().out.split("\n")[0]
    assert main(["lab", "zero2", str(target)]) == 2
    assert f"{target} exists" in capsys.readouterr().err
    guided = tmp_path / "guided.py"
    assert main(["lab", "zero2", str(guided), "--level", "guided"]) == 0
    assert guided.read_text() == skeleton_path("zero2", "guided").read_text() != target.read_text()
    out = capsys.readouterr().out
    assert "guided level" in out and "--level contract" in out  # and it names the other level
    with pytest.raises(SystemExit):  # argparse: not a level
        main(["lab", "zero2", str(tmp_path / "x.py"), "--level", "hints"])
    assert "invalid choice: 'hints' (choose from 'contract', 'guided')" in capsys.readouterr().err
    with pytest.raises(ValueError, match=r"unknown level 'hints'; the levels: contract, guided"):
        skeleton_path("zero2", "hints")
    assert main(["lab", "--list"]) == 0


def test_bad_input_is_named(pools, tmp_path, capsys):
    assert main(["check", "ddp", "--impl", str(tmp_path / "missing.py")]) == 2
    assert "no file" in capsys.readouterr().err
    with pytest.raises(ValueError, match=r"unknown lab 'ddp3'; the labs: ring, tree, ddp"):
        start("ddp3")
    empty = tmp_path / "empty.py"
    empty.write_text("x = 1\n")
    report = check("ddp", impl=empty, pools=pools, out=quiet)  # imported by the ranks, not here
    assert report.failed == "loading your file" and "defines no subclass of Stage" in report.why
    two = tmp_path / "two.py"
    two.write_text("from minizero.stages import DDP, ZeRO1\nclass A(DDP): pass\nclass B(ZeRO1): pass\n")
    report = check("ddp", impl=two, pools=pools, out=quiet)
    assert "defines 2 Stage classes (A, B)" in report.why
    broken = tmp_path / "broken.py"
    broken.write_text("def f(:\n")
    assert "SyntaxError" in check("ddp", impl=broken, pools=pools, out=quiet).why


def test_a_lab_is_checked_in_mixed_precision_too(pools):
    """Lesson 10's exercise: the learner's ZeRO in the paper's setting, against the same-recipe reference -- in fp16
    too, whose first steps overflow at torch's initial loss scale (the memory is measured on a step taken)."""
    for precision in ("bf16", "fp16"):
        report = check("zero2", precision=precision, examples=3, pools=pools, out=quiet)
        assert report.ok, report
    with pytest.raises(ValueError, match=r"lab 'ring' is not checked under mixed precision; labs that are: ddp"):
        check("ring", precision="bf16", pools=pools, out=quiet)


#: What a learner's file subclasses, by the class names the labs' methods are on: an empty subclass of each.
PACKAGE_CLASSES = {"Ring": "minizero.comm:RingComm", "Wire": "minizero.compress:Wire", "Unit": "minizero.parts.units:Unit",
                   "MasterWeights": "minizero.parts.masters:MasterWeights", "PowerSGDWire": "minizero.compress:PowerSGDWire"}
#: The class attribute by which a stage builds a class of the learner's file: ZeRO-3 its units, a stage its masters,
#: the PowerSGD lab's stage its wire.
BUILT_FROM = {"Unit": "unit_class", "MasterWeights": "master_class", "PowerSGDWire": "wire_class"}


@pytest.mark.parametrize("lab", list(LABS))
def test_a_file_whose_classes_are_empty_fails_naming_what_it_does_not_define(pools, lab, tmp_path):
    """Every class a lab's methods are on, subclassed and left empty (the stage handed the file's helper classes):
    the package's finished methods would run (the answer), so the checker says which ones the file does not define
    -- before any property."""
    spec = LABS[lab]
    owners = dict.fromkeys(todo.split(".")[0] for todo in spec.todo)
    if spec.kind is not Comm and spec.answer.__name__ not in owners:
        owners[spec.answer.__name__] = None  # the stage itself, which the checker takes from the file
    lines = []
    for owner in owners:
        module, name = (PACKAGE_CLASSES.get(owner) or f"{spec.answer.__module__}:{spec.answer.__name__}").split(":")
        body = [f"    {BUILT_FROM[o]} = {o}" for o in owners if o in BUILT_FROM and owner == spec.answer.__name__]
        lines += [f"from {module} import {name} as Given{owner}", f"class {owner}(Given{owner}):", *(body or ["    pass"]),
                  ""]
    path = tmp_path / f"empty_{lab.replace('-', '_')}.py"
    path.write_text("\n".join(lines) + "\n")
    report = check(lab, impl=str(path), examples=3, pools=pools, out=quiet)
    assert not report.ok and report.failed == "your methods are what runs", report
    for todo in spec.todo:
        assert f"your file does not define {todo}" in report.why, (todo, report.why)


def test_a_stage_that_does_not_use_the_files_unit_fails_naming_its_methods(pools, tmp_path):
    """The zero3 lab's Unit written in full, but the stage never handed it (``unit_class = Unit`` deleted): the
    package's Unit would run, so the file's is never called."""
    solution = answer_key("zero3", "guided").read_text()
    path = tmp_path / "zero3_without_unit_class.py"
    given = "from minizero.stages import ZeRO3 as GivenZeRO3\nfrom minizero.parts.units import Unit as GivenUnit"
    assert "from minizero.course.labs.skeletons.guided import zero3 as skeleton" in solution
    path.write_text(solution.replace("from minizero.course.labs.skeletons.guided import zero3 as skeleton", given)
                    .replace("class Unit(skeleton.Unit):", "class Unit(GivenUnit):")
                    .replace("class ZeRO3(skeleton.ZeRO3):\n    unit_class = Unit", "class ZeRO3(GivenZeRO3):\n    pass"))
    report = check("zero3", impl=str(path), examples=3, pools=pools, out=quiet)
    assert not report.ok and report.failed == "your methods are what runs", report
    assert ("are never called in a training step: is your Unit the class the stage uses?" in report.why
            and "Unit.pre_forward" in report.why), report.why


def test_a_bucket_view_not_restored_is_caught_now_that_the_checker_draws_the_users_own_zero_grad(pools, tmp_path):
    """The bucketed lab's answer without ``keep_grad_in``: right while ``.grad`` stays the bucket's view, wrong once
    the user's own ``optimizer.zero_grad()`` sets it to None -- which the checker draws now (the optimizer built after
    wrapping), as it draws the edge model.  It used to pass."""
    solution = answer_key("ddp-bucketed", "guided").read_text()
    path = tmp_path / "no_keep_grad_in.py"
    assert "        keep_grad_in(param, bucket.views[i])\n" in solution
    path.write_text(solution.replace("        keep_grad_in(param, bucket.views[i])\n", ""))
    report = check("ddp-bucketed", impl=str(path), examples=25, pools=pools, out=quiet)
    assert not report.ok and report.failed == "equivalence to single-device training", report
    assert re.search(r"'s [\w.]+ differs from", report.why), report.why  # a parameter named

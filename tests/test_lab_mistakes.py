"""The checker catches realistic slips it has no name for: every planted mistake under ``tests/lab_mistakes/`` fails
the property the table there expects, with a verdict that says where -- so a learner can go to the line.

What a verdict must name depends on what was measured (:data:`NAMES`): a wrong value, the parameter, the rank, the
step and the direction; a ring collective's result, the collective, the rank, the element and what it should be; a
cost (bytes, memory, overlap), the rank, the step and which way it is off.  A planted mistake whose verdict still
misses some of that is listed in :data:`tests.lab_mistakes.VAGUE` (an xfail on the words only); one the checker
passes is in :data:`~tests.lab_mistakes.HOLES` (a strict xfail).  The case judged is the first drawn one that fails,
not shrunk (:data:`tests.lab_mistakes.SHRINK_S`): the same on a busy machine as on a quiet one.
"""
from __future__ import annotations

import re

import pytest

from minizero.course.labs import check
from tests import lab_mistakes as planted
from tests.lab_mistakes import key_of, lab_of

RANK, STEP = ("the rank", r"\brank \d+"), ("the step", r"\bstep \d+")
VALUE = [("the parameter", r"\brank \d+'s [\w.]+"), RANK, STEP,
         ("the direction", r"too large|too small|opposite direction|never moved|ranks disagree|points another way|"
                           r"almost the right length|moved it by|elements are wrong")]
COLLECTIVE = ("the collective", r"\b(all_reduce|reduce_scatter|all_gather)\b")
COST = [RANK, STEP, ("the direction", r"too many|too few|too late|ran on the main thread")]
#: A learner's code that raised: the rank, their line (a lambda's too: a deferred collective is launched from one),
#: and what was wrong in words -- the package's own refusal
#: ("rank N: ...", "rank N's parameter: ..."), or the checker's reading of a bare error (a None: which parameters had no .grad).
RAISED = [RANK, ("the line of yours", r"\bat tests/lab_mistakes/\S+\.py:\d+ in (\w+|<lambda>)"),
          ("what was wrong, in words", r"raised \w+: rank \d+(: |'s )|had no \.grad")]
#: What a verdict must name, by the property that failed (a value property's words for any other).
NAMES = {
    planted.COLLECTIVES: [COLLECTIVE, RANK, ("the element", r"\belement \d+"), ("the direction", r"should be")],
    planted.RING_COST: [COLLECTIVE, RANK, ("the direction", r"too many|too few")],
    planted.BYTES: COST, planted.MEMORY: COST, planted.OVERLAP: COST, "one all-reduce per optimizer step, whatever K": COST,
    # PowerSGD's bytes: every step alike, so the rank and which way
    "bytes: the rest, then (n + m) r per matrix": [RANK, ("the direction", r"too many|too few")],
    planted.NESTS: [RANK, ("the direction", r"sent gradients|sent nothing")],
    planted.YOURS: [("the answer called, and where it is", r"minizero's own \w+\.\w+ \(\S+:\d+\)")],
    # the tree lab: a collective's result as the ring's; its cost as rounds and bytes, either way off
    "every all-reduce's result (SUM, AVG, MAX)": [COLLECTIVE, RANK, ("the element", r"\belement \d+|tensor of rank"),
                                                  ("the direction", r"should be|never entered|divided by N")],
    "rounds on the critical path and bytes per rank: the tree's": [
        COLLECTIVE, ("the direction", r"too many|too few|ledger counted|rounds on the critical path")],
    # the reshard lab: the rank, the flat group, and what its range must hold
    "every rank's new shard holds exactly its range": [
        RANK, ("the group", r"flat group \d+"),
        ("what it must hold", r"owns \[|should be|saved shards'|they are its|zeros")],
    # the hierarchical lab: a result as a collective's, on a node shape; a cost as bytes on a link class, counted
    # against the formula
    planted.HIERARCHICAL_RESULTS: [COLLECTIVE, RANK, ("the node shape", r"\b\d+ nodes? x \d+ ranks?\b"),
                                   ("the op", r"\b(SUM|AVG|MAX)\b"), ("the element", r"\belement \d+"),
                                   ("the direction", r"should be")],
    planted.HIERARCHICAL_LINKS: [COLLECTIVE, RANK, ("the link class", r"\b(intra|inter)-node link"),
                                 ("counted against the formula", r"sent \d+ bytes .* sends \d+"),
                                 ("the direction", r"too many|too few")],
}


def quiet(_):
    pass


def unnamed(report) -> list[str]:
    """What the verdict (``why`` and ``case``) does not name of what it must."""
    verdict = f"{report.why}\n{report.case}"
    # the answer key called where only a later property's run reaches it: named as "your methods are what runs" does
    needs = (NAMES[planted.YOURS] if "calls minizero's own" in report.why
             else RAISED if re.match(r"rank \d+ raised ", report.why) else NAMES.get(report.failed, VALUE))
    return [what for what, pattern in needs if not re.search(pattern, verdict)]


def _param(path):
    key = key_of(path)
    hole = planted.HOLES.get(key)
    marks = [pytest.mark.xfail(strict=True, reason=f"a hole in the checker: {hole}")] if hole else []
    return pytest.param(path, id=key, marks=marks)


@pytest.mark.parametrize("path", [_param(p) for p in planted.planted()])
def test_a_planted_mistake_fails_naming_where(pools, path):
    key = key_of(path)
    assert key in planted.EXPECTED, f"{key}: add the property it must fail to EXPECTED in tests/lab_mistakes/__init__.py"
    report = check(lab_of(path), impl=path, examples=planted.examples_for(key), pools=pools, out=quiet,
                   shrink_s=planted.SHRINK_S)
    assert not report.ok, f"{key} passes every property: a hole in the checker (or not a mistake)"
    assert report.failed in planted.expected(key), (report.failed, report.why)
    missing = unnamed(report)
    if key in planted.VAGUE:
        if missing:
            pytest.xfail(f"the verdict does not name {', '.join(missing)}: {planted.VAGUE[key]}")
        pytest.fail(f"{key}: the verdict now names everything it must: take it out of VAGUE")
    assert not missing, f"{key}: the verdict does not name {', '.join(missing)}: {report.why} | {report.case}"


def test_every_lab_has_five_planted_mistakes_the_checker_catches():
    """Issue 26's bar: at least five per lab that are not holes."""
    per_lab: dict[str, int] = {}
    for path in planted.planted():
        per_lab[lab_of(path)] = per_lab.get(lab_of(path), 0) + (key_of(path) not in planted.HOLES)
    assert per_lab and all(n >= 5 for n in per_lab.values()), per_lab


#: Properties no planted mistake can fail first, each with the reason it is kept: what it shows the learner, and why
#: an earlier property always sees the mistake first (issue 46: a property earns its place by a mistake of its own,
#: or is said to be redundant as a judge).
DEMONSTRATIONS = {
    ("reshard", "resumed on M ranks"): "the ranges property compares every field of every shard exactly, so a run "
    "resumed from shards that pass it is single-device training; shown to the learner, and a judge on its own "
    "(tests/test_lab_reshard.py: alone it names a restarted step count)",
    ("compress", "compressed bytes"): "the ring sums in the encoded tensor's dtype, so a wire sent wider than its 16 "
    "bits rounds its sums otherwise and fails the same-casts equivalence first (compress/"
    "encode_rounds_but_sends_full_width); the halved bytes are the lesson's figure",
}


def test_every_property_of_every_lab_is_the_first_failure_of_some_planted_mistake():
    """For every lab's every property, a planted mistake that fails it first -- or the property is a demonstration,
    said so with its reason."""
    from minizero.course.labs.catalogue import LABS
    from minizero.course.labs.property_table import PROPERTIES
    first: dict[str, set] = {}
    for key in planted.EXPECTED:
        first.setdefault(key.split("/")[0].replace("_", "-"), set()).update(planted.expected(key))
    unearned = [(lab.name, name) for lab in LABS.values() for name in lab.properties
                if PROPERTIES[name][0] not in first.get(lab.name, set()) and (lab.name, name) not in DEMONSTRATIONS]
    assert not unearned, f"properties no planted mistake fails first: {unearned}"
    stale = [pair for pair in DEMONSTRATIONS if PROPERTIES[pair[1]][0] in first.get(pair[0], set())]
    assert not stale, f"a planted mistake now fails these first: take them out of DEMONSTRATIONS: {stale}"

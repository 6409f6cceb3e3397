"""The mixed-precision lab's properties: the step through the fp32 masters, alone and inside ZeRO-2's training.

Merged into :data:`minizero.course.labs.properties.PROPERTIES` (the lab catalogue names them).  The step alone comes
first, on every rank (:mod:`minizero.course.labs.master_rounds`): it says which rank skipped and which stepped, which
a training run cannot -- there ranks that disagree stop in their next collective (one all-gathers the step's
shards, the other has nothing to share).  Then training itself, against the same-recipe reference.
"""
from __future__ import annotations

from dataclasses import replace

from hypothesis import strategies as st

from ...parts.precision import Precision
from ..harness.diagnosis import what_is_wrong
from ..harness.drawn import experiments
from ..harness.experiment import Experiment, reference_of
from .failed import Failed, describe
from .loading import Impl
from .master_rounds import MasterCase, master_rounds
from .raised import Raised

#: The case every run checks, whatever is drawn: an inf on rank 1 only -- under ZeRO, in rank 1's shard only.
AGREEMENT = MasterCase(world_size=2, precision="fp16", loss_scale=2.0 ** 10, sizes=(3, 2), missing=((), ()),
                       poison=(1, 0, 1, "inf"), optimizer="sgd", clip_first=True, outside=False, seed=1)


@st.composite
def master_cases(draw) -> MasterCase:
    n = draw(st.integers(1, 4))
    precision = draw(st.sampled_from(["fp16", "bf16"]))
    sizes = tuple(draw(st.lists(st.integers(0, 6), min_size=1, max_size=4)))
    missing = tuple(tuple(t for t in range(len(sizes)) if draw(st.booleans()) and draw(st.booleans()))
                    for _ in range(2))
    poisonable = [t for t, size in enumerate(sizes) if size and t not in missing[0]]
    poison = None
    if precision == "fp16" and poisonable and draw(st.booleans()):
        t = draw(st.sampled_from(poisonable))
        poison = (draw(st.integers(0, n - 1)), t, draw(st.integers(0, sizes[t] - 1)),
                  draw(st.sampled_from(["inf", "-inf", "nan"])))
    return MasterCase(world_size=n, precision=precision,
                      loss_scale=1.0 if precision == "bf16" else draw(st.sampled_from([2.0 ** 16, 2.0 ** 10, 1.0])),
                      sizes=sizes, missing=missing, poison=poison,
                      optimizer=draw(st.sampled_from(["sgd", "momentum", "adam"])), clip_first=draw(st.booleans()),
                      outside=draw(st.booleans()), seed=draw(st.integers(0, 2 ** 16)))


#: An overflow at the minimum loss scale (1): divergence, which step() must refuse -- a branch 25 draws rarely reach,
#: so it is checked whatever is drawn (issue 45).
FLOOR = MasterCase(world_size=2, precision="fp16", loss_scale=1.0, sizes=(2, 3), missing=((), ()),
                   poison=(0, 1, 2, "nan"), optimizer="momentum", clip_first=False, outside=False, seed=3)

#: One halving above the floor: a NaN at scale 2 skips the step and halves the scale to the minimum, 1 -- a step that
#: refuses there has told the scaler before looking (issue 45's rare branches, explicit).
ABOVE_FLOOR = MasterCase(world_size=2, precision="fp16", loss_scale=2.0, sizes=(2, 3), missing=((), ()),
                         poison=(1, 0, 1, "nan"), optimizer="sgd", clip_first=True, outside=False, seed=4)

#: Growth: the scale doubles after every clean step (a window of 1), so the scaler must hear of clean steps too, and
#: each listener the factor the scale changed by (2) -- torch's window of 2000 steps no draw reaches.
GROWTH = MasterCase(world_size=2, precision="fp16", loss_scale=2.0 ** 10, sizes=(3, 2), missing=((), ()), poison=None,
                    optimizer="adam", clip_first=False, outside=False, seed=7, window=1)

#: The optimizer built after wrapping, clipping first: the gradients were handed over, unscaled, at the end of backward,
#: so clipping's ``unscale_`` must change nothing -- a branch only the draws reached, a few times in 25 (issue 45).
OUTSIDE = MasterCase(world_size=3, precision="fp16", loss_scale=2.0 ** 10, sizes=(3, 0, 2), missing=((), (2,)),
                     poison=None, optimizer="adam", clip_first=True, outside=True, seed=11)

#: The second case a known mistake must also match to be named: three ranks, a NaN on the last, Adam, the optimizer
#: built after wrapping, a piece without elements and one without a gradient in the second step.
SECOND = MasterCase(world_size=3, precision="fp16", loss_scale=2.0 ** 12, sizes=(4, 0, 3), missing=((), (2,)),
                    poison=(2, 2, 0, "nan"), optimizer="adam", clip_first=False, outside=True, seed=5)


def _verdict(checker, case: MasterCase, impl=None) -> str | None:
    """What is wrong with the learner's class (or ``impl``'s) on ``case``, or None."""
    ranks = checker.on_ranks(case.world_size, master_rounds, impl or checker.impl, case)
    raised = [r for r in ranks if isinstance(r, Raised)]
    if raised:
        return str(raised[0])
    for step in range(max(len(steps) for steps in ranks)):
        taken = [steps[step] for steps in ranks if step < len(steps)]
        if not case.outside and all(r["raised"] is None for r in taken):
            skipped = [r for r, record in enumerate(taken) if not record["stepped"]]
            if skipped and len(skipped) < len(taken):
                stepped = [r for r in range(len(taken)) if r not in skipped]
                return (f"step {step + 1}: the ranks disagree -- rank(s) {skipped} skipped the step, rank(s) {stepped} "
                        f"took it (rank {stepped[0]}'s masters moved): an overflow on any rank must skip the step on "
                        f"every rank; each rank sees only its shard of the gradients, so the ranks must agree (one "
                        f"flag, all-reduced with MAX)")
        problem = next((record["problem"] for record in taken if record["problem"]), None)
        if problem:
            return problem
        busiest = max(range(len(taken)), key=lambda r: taken[r]["all_reduces"])
        if taken[busiest]["all_reduces"] > 1:
            return (f"step {step + 1}, rank {busiest}'s all-reduces: {taken[busiest]['all_reduces']}, too large a count "
                    f"-- agreeing on the overflow costs one all-reduce of one flag a step (unscale_ decides once a "
                    f"step: clipping calls it before step)")
    return None


def mixed_step(checker) -> str:
    """The step alone, on every rank, against the package's on the same gradients: drawn cases (world sizes 1-4,
    fp16 and bf16, an inf or NaN on one rank, the minimum scale, clipping first, the optimizer built before or after
    wrapping, tensors without a gradient or with no elements), shrunk to the smallest that fails; then, whatever was
    drawn, the agreement case (an inf on rank 1 only) and a NaN at the minimum scale (it must raise)."""
    failing = {}

    def examine(drawn):
        why = _verdict(checker, drawn[0])
        failing[why] = drawn[0]
        return (why, None) if why else None

    try:
        checker.search(st.tuples(master_cases()), examine, lambda case: case.describe())
    except Failed as failed:
        case = failing.get(failed.why)
        raise Failed(failed.why, failed.case, case and _named(checker, case, failed.why), failed.final) from None
    for case in (AGREEMENT, FLOOR, ABOVE_FLOOR, GROWTH, OUTSIDE):  # and, whatever was drawn, the case the lab is
        why = _verdict(checker, case)  # about, and the rare branches: the floor, one above it, growth, handed over
        if why:
            raise Failed(why, case.describe(), _named(checker, case, why))
    return (f"an inf on one rank skips the step on every rank; {checker.examples} drawn cases: world sizes 1-4, fp16 "
            f"and bf16, inf or NaN on one rank, the minimum scale, clipping first, the optimizer before or after "
            f"wrapping; then a NaN at the floor and one halving above it, a scale that grows every clean step, and "
            f"clipping with the optimizer built after wrapping (the gradients already handed over) -- "
            f"masters, working copy, loss scale, what the listeners hear and optimizer state equal the package's, "
            f"bit for bit")


def _named(checker, case: MasterCase, why: str) -> str | None:
    """The lab's known mistake whose class says exactly ``why`` on ``case`` -- and says what the learner's says on
    :data:`SECOND` too (one case alone rarely tells two slips apart)."""
    for mistake in checker.lab.mistakes:
        theirs = Impl.of(checker.lab, mistake)
        try:
            if _verdict(checker, case, theirs) == why and _verdict(checker, SECOND, theirs) == _verdict(checker, SECOND):
                return mistake.mistake
        except Failed:
            continue
    return None


@st.composite
def training_runs(draw, checker):
    """ZeRO-2 training in mixed precision as the suite draws it, without compression (the lab's step does not
    carry compression's error feedback), with an inf in one rank's gradient in some fp16 runs."""
    exp, n = draw(experiments(checker.key, world_sizes=(1, 2, 3, 4), max_accum=3, backends=("ring",),
                              stages=checker.stages, precision=True, wrap_first=True))
    options = {k: v for k, v in exp.options.items() if k not in ("compress", "error_feedback")}
    overflow_at = None
    if options["precision"].scaled and draw(st.booleans()):
        overflow_at = (draw(st.integers(0, exp.steps - 1)), draw(st.integers(0, n - 1)))
    return replace(exp, options=options, overflow_at=overflow_at), n


#: Trained first, whatever is drawn: an inf in rank 1's gradient at step 2 -- after the reduce-scatter, in one
#: rank's shard only -- with the optimizer given at wrap time (the stage steps it) and built after wrapping.
OVERFLOW_RUNS = [Experiment(task="mlp", model={"sizes": (3, 5, 2)}, optimizer="adam", lr=0.01, steps=3, accum=2,
                            dtype="float32", overflow_at=(1, 1), record_states=wrap_first is False,
                            options={"precision": Precision("fp16", loss_scale=2.0 ** 10)}, wrap_first=wrap_first)
                 for wrap_first in (False, True)]


def mixed_training(checker) -> str:
    def examine(drawn):
        exp, n = drawn
        try:
            results = checker.run(n, exp)
        except Failed as failed:
            if exp.options["precision"].scaled:
                failed.why += (" -- in fp16, did every rank skip the same steps? A rank that skips while another "
                               "steps leaves it alone in the all-gather of the step's shards")
            raise
        reference = reference_of(replace(exp, stages=checker.stages), n)
        for r, result in enumerate(results):
            if result.skipped_steps != reference.skipped_steps or result.loss_scales != reference.loss_scales:
                return (f"rank {r} skipped {result.skipped_steps} step(s), its loss scale after each step "
                        f"{result.loss_scales}; the same-recipe reference skipped {reference.skipped_steps}, "
                        f"{reference.loss_scales}"), results
        why = what_is_wrong(results, reference, exp, n)
        return (why, results) if why else None

    checker.fixed([(replace(exp, stage=checker.key), 2) for exp in OVERFLOW_RUNS], examine, describe)
    checker.search(training_runs(checker), examine, describe)
    return (f"{checker.examples} drawn runs of ZeRO-2 with your masters: fp16 (loss scales that overflow, an inf on "
            f"one rank) and bf16, reduced in 16 or 32 bits, world sizes 1-4, K up to 3, the edge model, clipping, the "
            f"optimizer before and after wrapping -- equal to the same-recipe reference, skipped steps and scales too")



PROPERTIES = {
    "mixed-precision step": ("the mixed-precision step on every rank", mixed_step),
    "mixed-precision training": ("ZeRO-2 with your masters equals the same-recipe reference", mixed_training),
}

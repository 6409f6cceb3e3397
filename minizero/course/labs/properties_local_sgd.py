"""The local-SGD lab's properties: where local SGD is single-device training, what the package's local SGD does
everywhere else, and its bytes.

Merged into :data:`minizero.course.labs.properties.PROPERTIES` (the lab catalogue names them).  Local SGD is *not*
single-device training (``LocalSGD.equivalent`` is False): with H > 1 each rank's later gradients are taken at
its own parameters, and an optimizer with state keeps per-rank state.  So the learner's stage is held to
single-device training only where it is that -- H = 1 with plain SGD -- and elsewhere, rank by rank and step by
step, to the package's own local SGD on the same run (as ``tests/test_contrast_stages.py`` holds the package's).
"""
from __future__ import annotations

from dataclasses import replace

import torch
from hypothesis import strategies as st

from ...stages import LocalSGD
from ..harness.diagnosis import initial_parameters, update_words, what_is_wrong
from ..harness.drawn import experiments
from ..harness.equivalence import RTOL, agrees, parameter_errors
from ..harness.experiment import Experiment, reference_of
from .failed import Failed, describe

#: DiLoCo's outer optimizer as drawn: none (plain averaging), the paper's (0.7, Nesterov 0.9), lr 1 without momentum
#: (plain averaging again, through the anchor), and one in between.
OUTER = [{}, {"outer_lr": 0.7, "outer_momentum": 0.9}, {"outer_lr": 1.0, "outer_momentum": 0.0},
         {"outer_lr": 0.5, "outer_momentum": 0.5}]


def _runs(checker, **fixed):
    """The suite's drawn runs (world sizes 1-4, K up to 3, uneven and empty batches, the edge model), the optimizer
    given at wrap time (local SGD steps it itself), with ``fixed`` fields replaced."""
    return experiments(checker.key, world_sizes=(1, 2, 3, 4), max_accum=3, stages=checker.stages).map(
        lambda d: (replace(d[0], wrap_first=False, **fixed), d[1]))


def h1_is_single_device(checker) -> str:
    """H = 1 with plain SGD: mean_r(p - lr g_r) = p - lr mean_r(g_r), DDP's step (no clipping: each rank clips its
    own gradient)."""
    def examine(drawn):
        exp, n = drawn
        results = checker.run(n, exp)
        why = what_is_wrong(results, reference_of(replace(exp, stages=checker.stages), n), exp, n)
        return (why, results) if why else None

    checker.search(_runs(checker, optimizer="sgd", clip=None, options={"average_every": 1}), examine, describe)
    return (f"{checker.examples} drawn runs: world sizes 1-4, K up to 3, uneven and empty batches, the edge model, "
            f"float64 and float32 -- averaging after every plain SGD step is single-device training")


@st.composite
def local_runs(draw, checker):
    """H from 1 to 3, at least H steps, plain averaging or DiLoCo, any optimizer the suite draws."""
    exp, n = draw(_runs(checker))
    every = draw(st.integers(1, 3))
    options = {"average_every": every, **draw(st.sampled_from(OUTER))}
    return replace(exp, steps=every * draw(st.integers(1, 2)) + draw(st.integers(0, 1)), options=options), n


def _same_everywhere(results: list, step: int) -> bool:
    """Do every rank's parameters agree after ``step`` (bit for bit: an average leaves the same bits everywhere)?"""
    first = results[0].params[step]
    return all(torch.equal(r.params[step][k], first[k]) for r in results for k in first)


def departs(results: list, theirs: list, exp: Experiment) -> str | None:
    """Where the learner's run first leaves the package's: the step, the rank, the parameter, which way its update is
    off -- and whether an average happened there that should not have, or did not that should."""
    every, rtol = exp.options["average_every"], RTOL[exp.dtype]
    for step in range(exp.steps):
        for rank, (mine, its) in enumerate(zip(results, theirs, strict=True)):
            for name, err, scale in parameter_errors(mine.params[step], its.params[step], exp.dtype):
                if err <= rtol * scale:
                    continue
                kind = "an averaging step" if (step + 1) % every == 0 else "a local step"
                why = (f"after step {step + 1} (H = {every}: {kind}), rank {rank}'s {name} differs from the package's "
                       f"local SGD by {err:.3g}")
                agree, should = _same_everywhere(results, step), _same_everywhere(theirs, step)
                if len(results) > 1 and agree != should:
                    return why + (" -- your ranks agree after it, the package's ranks disagree: an average happened "
                                  "where none should (steps H, 2H, ... counted from 1)" if agree else
                                  " -- your ranks disagree after it, the package's agree: no average happened where "
                                  "one should")
                before = its.params[step - 1][name] if step else initial_parameters(exp)[name]
                why += " -- " + update_words(mine.params[step][name] - before, its.params[step][name] - before,
                                             rtol * scale, len(results), exp.accum, theirs="the package's")
                if "outer_lr" in exp.options and (step + 1) % every == 0:
                    return why + (f"; the outer step (DiLoCo, outer lr {exp.options['outer_lr']:g}, momentum "
                                  f"{exp.options['outer_momentum']:g}): the anchor's gradient is anchor - mean, the "
                                  f"outer optimizer steps it, every replica becomes the anchor")
                return why
    return None


#: Checked first, whatever is drawn: plain averaging over two periods and a step past them, and DiLoCo's Nesterov
#: outer step twice (its momentum carried from one average to the next).
FIXED = [(Experiment(task="mlp", model={"sizes": (3, 4, 2)}, optimizer="momentum", lr=0.05, steps=5, dtype="float64",
                     options={"average_every": 2}), 3),
         (Experiment(task="mlp", model={"sizes": (3, 4, 2)}, optimizer="adam", lr=0.01, steps=4, dtype="float64",
                     options={"average_every": 2, "outer_lr": 0.7, "outer_momentum": 0.9}), 2)]


def matches_the_package(checker) -> str:
    def examine(drawn):
        exp, n = drawn
        results = checker.run(n, exp)
        theirs = checker.package(n, replace(exp, stage=LocalSGD.name))
        why = departs(results, theirs, exp)
        return (why, results) if why else None

    checker.fixed([(replace(exp, stage=checker.key), n) for exp, n in FIXED], examine, describe)
    checker.search(local_runs(checker), examine, describe)
    return (f"{checker.examples} drawn runs: H = 1-3, plain averaging and DiLoCo's outer step, SGD, momentum and "
            f"Adam, world sizes 1-4, K up to 3, the edge model -- every rank, every step, the package's local SGD")


#: (world size, H, K, outer, task): the byte cases, each run for 2H steps -- a multiple of H, where the formula is
#: exact.  The edge model's frozen parameters are not averaged: the same on every rank, they are not Ψ (issue 45).
MLP = ("mlp", {"sizes": (5, 7, 3)})
BYTE_CASES = [(2, 2, 1, {}, MLP), (3, 3, 2, {"outer_lr": 0.7, "outer_momentum": 0.9}, MLP), (3, 1, 2, {}, MLP),
              (4, 2, 1, {}, MLP), (3, 2, 1, {}, ("edge", {}))]


def local_sgd_bytes(checker) -> str:
    for n, every, k, outer, (task, model) in BYTE_CASES:
        exp = Experiment(stage=checker.key, task=task, model=model, steps=2 * every, accum=k,
                         dtype="float32", optimizer="adam", options={"average_every": every, **outer})
        results = checker.run_case(n, exp)
        formula = LocalSGD.sent_bytes_per_step(results[0].psi, n, results[0].grad_bytes, results[0].param_bytes,
                                               average_every=every)
        # The formula is the mean over ranks: a ring all-reduce of a tensor smaller than N chunks it unevenly.
        sent = sum(r.sent_bytes for r in results) / (n * exp.steps)
        kinds = sorted({kind for r in results for kind in r.sent_by_kind})
        if not agrees(sent, formula) or kinds != ["all_reduce"]:
            rank = max(range(n), key=lambda r: results[r].sent_bytes)
            ratio = sent / formula if formula else float("inf")
            way = "nothing: the ranks never averaged" if sent == 0 else (
                f"{ratio:.3g}x the formula, too {'large' if ratio > 1 else 'small'}: one all-reduce of every "
                f"trainable parameter, in its own dtype, every H-th step, and nothing more")
            raise Failed(f"the ranks' traffic from step 1 to step {exp.steps}: {sent:,.0f} bytes a step each on "
                         f"average as {kinds} (rank {rank}'s the most, {results[rank].sent_bytes / exp.steps:,.0f}); "
                         f"the formula -- one all-reduce of the parameters every H = {every} steps -- says "
                         f"{formula:,.0f} as ['all_reduce'] -- {way}", describe(exp, n))
    # The model of two dtypes (a float32 layer feeding a float64 one): each parameter averaged in its own dtype, as
    # the package's stage does.  One flat buffer of both promotes the float32 ones to 8 bytes -- values that pass
    # float32's tolerance, bytes that do not (a ring's traffic over all ranks is 2(N-1) x the bytes, however cut).
    exp = Experiment(stage=checker.key, task="mixed", steps=4, dtype="float32", optimizer="adam",
                     options={"average_every": 2})
    mine, theirs = checker.run_case(3, exp), checker.package(3, replace(exp, stage=LocalSGD.name))
    sent, due = (sum(r.sent_bytes for r in results) / (3 * exp.steps) for results in (mine, theirs))
    if not agrees(sent, due):
        rank = max(range(3), key=lambda r: mine[r].sent_bytes)
        raise Failed(f"the ranks' traffic from step 1 to step {exp.steps} on a model of two dtypes: {sent:,.0f} bytes "
                     f"a step each on average (rank {rank}'s the most, {mine[rank].sent_bytes / exp.steps:,.0f}); the "
                     f"package's local SGD sends {due:,.0f} -- {sent / due:.3g}x, too "
                     f"{'large' if sent > due else 'small'}: each parameter is averaged in its own dtype" +
                     (" (torch.cat of a float32 and a float64 tensor is float64: 8 bytes for every float32 element)"
                      if sent > due else " (the float64 ones at 8 bytes: not cast down)"), describe(exp, 3))
    return ("one all-reduce of the trainable parameters every H steps (N = 2-4, H = 1-3, K = 1 and 2, DiLoCo's too, "
            "the edge model's frozen ones left out, a model of two dtypes each in its own)")


PROPERTIES = {
    "local-sgd H=1": ("H = 1 with plain SGD is single-device training", h1_is_single_device),
    "local-sgd package": ("every rank, every step, the package's local SGD", matches_the_package),
    "local-sgd bytes": ("bytes: one all-reduce of the parameters every H steps", local_sgd_bytes),
}

"""The cost properties a lab is judged by: bytes sent, model state held, and overlap -- each measured (the ledger,
the stage's held tensors, the overlap probe) and held to the stage's own formula, as the suite holds the package's
stages (:mod:`minizero.course.harness.costs`).  Apart from :mod:`.properties`, whose table lists them."""
from __future__ import annotations

from dataclasses import replace

from ...stages import Stage
from ..harness.costs import BYTES_REL, bytes_problem, gathered_problem, memory_problem, overlap_problem
from ..harness.equivalence import agrees
from ..harness.experiment import Experiment
from ..harness.optimizers import STATE_TENSORS
from .failed import Failed, describe
from .raised import Raised
from .ranks import overlap_probe

#: Where every cost property is measured: every world size the equivalence draws, one micro-batch and several --
#: both at N = 3, whose shards are uneven.
COST_CASES = ((1, 1), (2, 2), (3, 1), (3, 2), (4, 2))


def taken_steps(options: dict) -> dict:
    """``options`` with fp16's loss scale at 1: at torch's initial scale (2^16) the first steps overflow and are
    skipped -- no optimizer state created, no updated shard all-gathered -- and a cost formula is for a step taken."""
    if getattr(options.get("precision"), "scaled", False):
        return {**options, "precision": replace(options["precision"], loss_scale=1.0)}
    return options


def sent_bytes(checker, options: dict | None = None) -> str:
    """Bytes each rank sent in each step as the ledger counted them, against the stage's formula; the kinds of
    collective against the answer key's -- at every world size 1-4, K = 1 and K = 2 (:mod:`minizero.course.harness.costs`,
    as the suite judges the package's stages)."""
    judged_wires = options is None and takes_a_wire(checker)
    options = taken_steps({**checker.options, **(options or {})})
    for n, k in COST_CASES:
        exp = Experiment(stage=checker.key, task="gpt", steps=2, accum=k, dtype="float32", optimizer="adamw",
                         options=options)
        results = checker.run_case(n, exp)
        first = results[0]
        formula = checker.lab.answer.sent_bytes_per_step(first.psi, n, first.grad_bytes, first.param_bytes, **options)
        kinds = set(checker.package(n, replace(exp, stage=checker.lab.stage))[0].sent_by_kind)
        problem = bytes_problem(results, formula, kinds)
        if problem:
            average = sum(x.sent_bytes for x in results) / (n * exp.steps)
            raise Failed(problem, describe(exp, n), checker.diagnose_cost(exp, n, average, set(first.sent_by_kind)))
    if judged_wires:
        wire_bytes(checker)
    return (f"the ledger's bytes in every step, on every rank, equal the formula ({checker.lab.answer.__name__}) at "
            f"N = 1-4, K = 1 and 2 ({', '.join(f'N={n} K={k}' for n, k in COST_CASES)})"
            + (f"; under the {' and '.join(JUDGED_WIRES)} wires, the package's own bytes" if judged_wires else ""))


#: The wires whose bytes are judged too, wherever the stage takes one: a collective that leaves ``wire=`` out
#: still averages right -- at full width, twice the 16-bit wire's bytes and about four times int8's (issue 45).
JUDGED_WIRES = ("fp16", "int8")
WIRE_CASES = ((2, 1), (3, 2))


def ratio(mine: float, stage: float) -> str:
    return f"{mine / stage:.3g}x as many ({'too many' if mine > stage else 'too few'})" if stage else "where it sends none"


def takes_a_wire(checker) -> bool:
    """The lab's stage averages over a wire (it takes ``compress``), and the check is in fp32 (a codec is refused
    under mixed precision)."""
    stage = checker.lab.answer
    return issubclass(stage, Stage) and "compress" in stage.option_names() and "precision" not in checker.options


def wire_bytes(checker) -> None:
    """Each rank's bytes in each step under each of :data:`JUDGED_WIRES` against the package's own stage's (the suite
    holds those to the codecs' formulas), by the same kinds of collective -- within the formula's tolerance: a ring
    cuts each tensor into N chunks, so one all-reduce per parameter sends a few bytes more or less than one flat
    buffer does."""
    for spec in JUDGED_WIRES:
        for n, k in WIRE_CASES:
            exp = Experiment(stage=checker.key, task="gpt", steps=2, accum=k, dtype="float32", optimizer="adamw",
                             options={**checker.options, "compress": spec})
            mine, answer = checker.run_case(n, exp), checker.package(n, replace(exp, stage=checker.lab.stage))
            for rank, (a, b) in enumerate(zip(mine, answer, strict=True)):
                for step, (sent, due) in enumerate(zip(a.sent_per_step, b.sent_per_step, strict=True), 1):
                    if not agrees(sent, due, BYTES_REL) or set(a.sent_by_kind) != set(b.sent_by_kind):
                        raise Failed(f"under compress={spec!r} rank {rank} sent {sent:,.0f} bytes in step {step} as "
                                     f"{sorted(a.sent_by_kind)} where the stage sends {due:,.0f} as "
                                     f"{sorted(b.sent_by_kind)}: {ratio(sent, due)}. Does every collective that "
                                     f"averages gradients carry the stage's wire (wire=self.wire)?", describe(exp, n))


def one_sync_per_step(checker) -> str:
    for k in (1, 3):
        exp = Experiment(stage=checker.key, task="mlp", steps=2, accum=k, dtype="float64")
        results = checker.run_case(3, exp)
        formula = checker.lab.answer.sent_bytes_per_step(results[0].psi, 3, 8, 8)
        problem = bytes_problem(results, formula)
        if problem:
            average = sum(r.sent_bytes for r in results) / (3 * exp.steps)
            raise Failed(f"{problem} -- one all-reduce of the gradients per optimizer step, whatever K",
                         describe(exp, 3), checker.diagnose_cost(exp, 3, average))
    return "K = 1 and K = 3 micro-batches each send one all-reduce per optimizer step"


def memory(checker) -> str:
    """Model state each rank holds after a step, against the stage's formula, at every world size 1-4, K = 1 and
    2.  What is counted is what the stage's ``held_tensors()`` accounts for -- the machinery's buffers, parameters,
    gradients and optimizer states; a tensor a learner keeps on an attribute of their own is not seen.  Where the
    parameters are sharded, the memory observer's count of gathered parameters is held to what they point into as
    allocated, which after a step is nothing (:func:`~minizero.course.harness.costs.gathered_problem`)."""
    options = taken_steps(checker.options)
    words = checker.lab.answer.state_formula(4, 2, **checker.options)
    for n, k in COST_CASES:  # the cases (and so the runs) of `sent_bytes`: the state held after their two steps
        exp = Experiment(stage=checker.key, task="gpt", steps=2, accum=k, dtype="float32", optimizer="adamw",
                         options=options)
        results = checker.run_case(n, exp)
        formula = checker.lab.answer.state_bytes(results[0].psi, n, 4, STATE_TENSORS["adamw"], **checker.options)
        problem = memory_problem(results, formula, words) or (
            gathered_problem(results) if checker.lab.answer.shards.parameters else None)
        if problem:
            raise Failed(problem, describe(exp, n))
    if checker.lab.answer.shards.parameters:  # two param groups: a unit of two flat groups, one freed and one kept
        exp = replace(exp, param_groups=True, accum=1)
        problem = gathered_problem(checker.run_case(3, exp))
        if problem:
            raise Failed(problem, describe(exp, 3))
    return (f"model state per rank equals {words} (AdamW) at N = 1-4, K = 1 and 2 "
            f"({', '.join(f'N={n} K={k}' for n, k in COST_CASES)})")


def overlap(checker) -> str:
    """Backward keeps computing while the first bucket's collective is in flight -- with one micro-batch and with
    two (the first, inside ``no_sync()``, launching nothing), on two and on three ranks."""
    for n, k in ((2, 1), (2, 2), (3, 2)):
        exp = Experiment(stage=checker.key, task="mlp", model={"sizes": (8, 16, 16, 4)}, steps=2, accum=k,
                         dtype="float32", optimizer="sgd", options={**checker.options, "bucket_mb": 1e-9})
        case = describe(exp, n) + " (one parameter per bucket)"
        seen = checker.on_ranks(n, overlap_probe, checker.impl, exp)
        raised = [r for r in seen if isinstance(r, Raised)]
        problem = str(raised[0]) if raised else overlap_problem(seen, exp.steps)
        if problem:
            raise Failed(problem, case)
    return "the first bucket's collective leaves while backward is still computing (N = 2 and 3, K = 1 and 2)"

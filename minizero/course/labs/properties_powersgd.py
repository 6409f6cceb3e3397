"""The PowerSGD lab's properties: the learner's step inside the package's wire, against the same-steps reference.

Merged into :data:`minizero.course.labs.property_table.PROPERTIES`.  The reference
(:func:`minizero.course.harness.casts_reference.powersgd_average`) runs the package's steps on every rank's buffer at
once, with the all-reduces emulated in the ring's order; the learner's ``power_step`` runs on the ranks over
the real ring.  Drawn as the suite draws: world sizes 1-4, K up to 3, uneven batches, the edge model, the
GPT -- and the PowerSGD settings (rank 1-3, QR above 2; warm start on and off; error feedback on and off).
"""
from __future__ import annotations

from dataclasses import replace

from hypothesis import strategies as st

from ..harness.drawn import experiments
from ..harness.experiment import Experiment
from .failed import Failed, describe
from .properties import against_the_reference

#: The contract's branches a few draws may miss, tried whatever is drawn: rank 3 (torch.linalg.qr's branch), and an
#: epsilon added to each norm (never drawn: SPECS keep torch's default 0), both on the GPT at N = 3, with error feedback.
FIXED = [(Experiment(task="gpt", steps=3, accum=2, dtype="float64", optimizer="adam",
                     options={"compress": spec, "error_feedback": True}), 3)
         for spec in ("powersgd:rank=3,min_rate=1", "powersgd:rank=2,epsilon=0.25", "powersgd:rank=1,epsilon=0.25")]

SPECS = ("powersgd:rank=1", "powersgd:rank=2", "powersgd:rank=3,min_rate=1", "powersgd:rank=2,warm_start=0")


def equivalence(checker) -> str:
    strategy = experiments(checker.key, world_sizes=(1, 2, 3, 4), max_accum=3, compress=True, backends=("ring",),
                           stages=checker.stages, tasks=("mlp", "edge", "gpt", "gpt")).flatmap(
        lambda d: st.tuples(st.sampled_from(SPECS), st.booleans()).map(
            lambda s: (replace(d[0], options={**d[0].options, "compress": s[0], "error_feedback": s[1]}), d[1])))

    examine = against_the_reference(checker)
    checker.search(strategy, examine, describe)
    checker.fixed([(replace(exp, stage=checker.key), n) for exp, n in FIXED], examine, describe)
    return (f"{checker.examples} drawn examples: world sizes 1-4 (3 included), K up to 3, uneven batches, the edge "
            f"model and the GPT, PowerSGD at rank 1-3 (QR above 2), warm start on and off, error feedback on and off; "
            f"then, whatever is drawn, rank 3 (QR) and a nonzero epsilon, each with error feedback, at N = 3")


def sent_bytes(checker) -> str:
    """What the ring carried per step, against three all-reduces of the rest, the Ps and the Qs."""
    for n in (2, 3):
        exp = Experiment(stage=checker.key, task="gpt", steps=2, dtype="float64",
                         options={"compress": "powersgd:rank=2", "error_feedback": True})
        results = checker.run_case(n, exp)
        want = results[0].wire_sent_bytes_per_step
        per_rank = [r.sent_by_kind.get("all_reduce", 0) / exp.steps for r in results]
        counted = sum(per_rank) / n  # the formula is the ranks' average: a ring's uneven chunks differ by rank
        if abs(counted - want) > 1e-9 * want:
            most = max(range(n), key=lambda r: abs(per_rank[r] - want))
            raise Failed(f"the ranks sent {counted:,.0f} bytes a step each on average in all-reduces (rank {most}: "
                         f"{per_rank[most]:,.0f}); PowerSGD's three all-reduces (the uncompressed tensors, n r per "
                         f"matrix for P, m r for Q) carry {want:,.0f}: " +
                         ("too many -- is a whole matrix all-reduced?" if counted > want else
                          "too few -- is a factor never all-reduced?"), describe(exp, n))
    return "the ring carries exactly the rest, then n r and m r per matrix (N = 2 and 3)"


PROPERTIES = {
    "powersgd equivalence": ("equivalence to a reference taking the same PowerSGD steps", equivalence),
    "powersgd bytes": ("bytes: the rest, then (n + m) r per matrix", sent_bytes),
}

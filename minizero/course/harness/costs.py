"""What a stage costs against what its formula says -- one definition, used by the suite and by the labs' checker.

Each function takes the ranks' results of one experiment and returns None when
the cost is the formula's, or what is wrong in words: the rank, the step, the
ratio to the formula and its direction.  The suite asserts ``... is None``;
the checker (:mod:`minizero.course.labs.properties_costs`) says the words to a learner.

* **bytes** -- what the ledger counted in each step, on each rank, against the
  stage's ``sent_bytes_per_step`` (the ring's 2(N-1)/N Psi b for DDP and ZeRO-1/2,
  3(N-1)/N Psi b for ZeRO-3), and the kinds of collective that carried them;
* **memory** -- what each rank's ``held_tensors()`` hold after a step, against
  ``state_bytes`` (16 Psi, 4 Psi + 12 Psi/N, 16 Psi/N ... the paper's Table 1);
* **overlap** -- from a probe of each synchronising backward
  (:func:`minizero.course.harness.overlap.backward_launches`): a collective left while
  gradients were still to come, and none ran on the main thread meanwhile.
"""
from __future__ import annotations

from .equivalence import agrees

BYTES_REL = 0.02  # padding to a multiple of N adds a little: at most N - 1 elements per flat group


def how_far(measured: float, formula: float, unit: str = "bytes") -> str:
    """A measured cost against its formula: the ratio and the direction."""
    if formula == 0:
        return f"{measured:,.0f} {unit} where the formula says none"
    ratio = measured / formula
    return f"{ratio:.3g}x the formula's {formula:,.0f} ({'too many' if ratio > 1 else 'too few'})"


def bytes_problem(results: list, formula: float, kinds: set[str] | None = None, rel: float = BYTES_REL) -> str | None:
    """Every rank's bytes in every step within ``rel`` of ``formula`` (per rank per step), carried by ``kinds`` of
    collective when given."""
    for rank, result in enumerate(results):
        got = set(result.sent_by_kind)
        for step, sent in enumerate(result.sent_per_step):
            if not agrees(sent, formula, rel) or (kinds is not None and got != kinds):
                return (f"rank {rank} sent {sent:,.0f} bytes in step {step + 1} as {sorted(got)}: "
                        f"{how_far(sent, formula)}" + (f", as {sorted(kinds)}" if kinds is not None else ""))
    return None


def memory_problem(results: list, formula: float, words: str = "", rel: float = BYTES_REL) -> str | None:
    """Every rank's model state (``held_bytes``, by kind) within ``rel`` of ``formula`` after the last step."""
    for rank, result in enumerate(results):
        held = result.held_bytes
        if not agrees(held["total"], formula, rel):
            parts = ", ".join(f"{k} {v:,}" for k, v in held.items() if k != "total")
            return (f"after step {len(result.params)}, rank {rank} holds {held['total']:,} bytes of model state "
                    f"({parts}): {how_far(held['total'], formula)}" + (f" -- {words}" if words else ""))
    return None


def gathered_problem(results: list) -> str | None:
    """A stage that shards its parameters (ZeRO-3), right after its last step: what the parameters point into as
    allocated, which is nothing -- every unit is resharded after its backward (a unit that frees only some of its flat
    groups keeps full parameters between steps) -- and the memory observer's count of gathered parameters, which must
    agree (a unit freed or gathered without telling the observer leaves the two apart, and the memory tools would
    report a wrong working set)."""
    for rank, result in enumerate(results):
        after, seen, pointed = len(result.params), result.gathered_after_bytes, result.parameter_storage_bytes
        if pointed:
            return (f"after step {after}, rank {rank}'s parameters still point into {pointed:,} bytes of gathered full "
                    f"parameters, where every unit is resharded after its backward (too many): a unit left some of its "
                    f"flat groups gathered -- free every group")
        if seen != pointed:
            counted = "too many" if seen > pointed else "too few"
            return (f"after step {after}, rank {rank}'s memory observer counts {seen:,} bytes of gathered parameters, "
                    f"but the parameters point into {pointed:,} bytes of allocated storage ({counted} counted): a "
                    f"unit {'freed' if seen > pointed else 'gathered'} {abs(seen - pointed):,} bytes without telling "
                    f"the observer (free with Unit._free, gather with start_gather: each reports what it does)")
    return None


def overlap_problem(seen: list[list[dict]], steps: int) -> str | None:
    """Each rank's synchronising backwards as :func:`~minizero.course.harness.overlap.backward_launches` saw them: one per
    step, each with a collective submitted while gradients were still to come, and none run on the main thread
    (which would make backward wait for it)."""
    for rank, backwards in enumerate(seen):
        if len(backwards) != steps:
            return f"rank {rank}: {len(backwards)} synchronising backward(s) seen in {steps} steps"
        for step, b in enumerate(backwards):
            if b["blocking"]:
                return (f"rank {rank}, step {step + 1}: {_a(b['blocking'][0])} ran on the main thread during "
                        f"backward, so backward waited for it -- return the collective from the launch instead, "
                        f"for the communication thread to run")
            if not b["launches"] or b["launches"][0] >= b["params"] - 1:
                return (f"rank {rank}, step {step + 1}: no bucket left while backward still had gradients to compute "
                        f"(the first launch came after {b['launches'][0] if b['launches'] else 'none'} of "
                        f"{b['params']} gradients): too late -- nothing overlapped")
    return None


def _a(kind: str) -> str:
    """'an all_reduce', 'a reduce_scatter'."""
    return f"{'an' if kind[0] in 'aeiou' else 'a'} {kind}"

"""How a property says it failed: :class:`Failed`, with the case it failed on in a learner's words (:func:`describe`).

Written apart from the properties so that every lab's properties -- the core ones in
:mod:`minizero.course.labs.properties`, a new lab's in a module of its own -- raise the same thing, and the
checker (:mod:`minizero.course.labs.check`) reads it the same way.
"""
from __future__ import annotations

from ..harness.experiment import Experiment


class Failed(Exception):
    """A property failed: ``case`` is the smallest example, in words; ``why`` what went wrong there.
    ``final``: the ranks were stopped or died (or the file did not import) -- not a wrong number, so nothing
    a smaller example would say better: it is not shrunk."""

    def __init__(self, why: str, case: str = "", mistake: str | None = None, final: bool = False):
        super().__init__(why)
        self.why, self.case, self.mistake, self.final = why, case, mistake, final


def describe(exp: Experiment, world_size: int) -> str:
    """An experiment as a learner reads it: 'world size 2, K = 2, sgd (lr 0.01), mlp (3, 1), float64, ...'."""
    model = exp.task + (" (" + ", ".join(f"{k} {v}" for k, v in exp.model.items()) + ")" if exp.model else "")
    batch = f"samples per rank {list(exp.rank_sizes)}" if exp.rank_sizes else f"{exp.micro_batch} sample(s) per micro-batch"
    extras = [f"{k}={v}" for k, v in sorted(exp.options.items())]
    extras += [f"clip {exp.clip}"] if exp.clip else []
    extras += [f"backwards synchronising: micro-batch(es) {[k + 1 for k, s in enumerate(exp.syncs) if s]} of "
               f"{exp.accum} (the rest inside no_sync())"] if exp.syncs else []
    extras += [f"backwards in the order '{exp.order}'"] if exp.order else []
    extras += ["two param groups"] if exp.param_groups else []
    extras += ["the optimizer built after wrapping (the loop zeroes and steps it)"] if exp.wrap_first else []
    extras += ["the loop zeroes with model.zero_grad()"] if exp.zero_grad == "model" else []
    extras += ["every collective run the moment it is launched, the launcher waiting"] if exp.eager_launch else []
    extras += [f"in step {exp.launch_fails_at + 1} the first bucket's collective fails on every rank (before any "
               f"message leaves), the error is caught and the step run again"] if exp.launch_fails_at is not None else []
    return (f"world size {world_size}, K = {exp.accum} micro-batch(es), {exp.optimizer} (lr {exp.lr}), {model}, "
            f"{batch}, {exp.dtype}, {exp.steps} step(s), {exp.backend} collectives"
            + (f", {', '.join(extras)}" if extras else ""))

"""Which library lines one training step runs: the files a reader must open to follow a stage's step.

A stage's step is forward, backward and the optimizer step as the one training loop drives them
(:func:`minizero.run.train.train_step`), after a first step has run (so nothing lazy is counted).  Every rank
traces its main thread and its communication thread (a bucket's reduce-scatter, defined in the stage's file,
runs there) with :func:`sys.settrace`, and keeps the lines of the library's files -- not the course's, not
torch's.  ``comm/`` is counted apart, as the old hand-typed table counted it: the collectives are read once,
in lesson 1, not again for every stage.
"""
from __future__ import annotations

import sys
from pathlib import Path

from ...run.launch import Rank, run
from ...run.train import shard_step, train_step
from .equivalence import DTYPES
from .experiment import Experiment, build
from .tasks import TASKS

LIBRARY = Path(__file__).resolve().parents[2]  # minizero/
COURSE = LIBRARY / "course"


def library_file(filename: str) -> str | None:
    """``stages/zero2.py`` for a library file, None for the course's, torch's or the standard library's."""
    path = Path(filename).resolve()
    if not path.is_relative_to(LIBRARY) or path.is_relative_to(COURSE):
        return None
    return path.relative_to(LIBRARY).as_posix()


def traced_step(me: Rank, exp: Experiment) -> dict[str, list[int]]:
    """This rank's library lines run by one training step of ``exp`` (after one untraced step): file -> lines."""
    stage, model, comm, _ = build(me, exp)
    task, lines = TASKS[exp.task], {}

    def tracer(frame, event, arg):
        name = library_file(frame.f_code.co_filename)
        if name is None:
            return None  # no line events inside torch or the course
        if event == "line" or event == "call":
            lines.setdefault(name, set()).add(frame.f_lineno)
        return tracer

    def one_step(s: int) -> None:
        x, y = task.make_batch(exp.global_batch(me.world_size), exp.seed, s, DTYPES[exp.dtype], **exp.model)
        train_step(stage, shard_step(x, y, me.rank, me.world_size, exp.accum))

    try:
        one_step(0)
        comm.submit(lambda: sys.settrace(tracer)).wait()  # the communication thread's own trace
        sys.settrace(tracer)
        try:
            one_step(1)
        finally:
            sys.settrace(None)
            comm.submit(lambda: sys.settrace(None)).wait()
    finally:
        comm.close()
    return {name: sorted(numbers) for name, numbers in lines.items()}


def step_files(world_size: int, stage: str, pool=None, **experiment) -> dict[str, list[int]]:
    """Every rank's traced lines of one step of ``stage``, merged: file -> lines."""
    exp = Experiment(stage=stage, steps=2, **experiment)
    per_rank = pool.run(traced_step, exp) if pool is not None else run(traced_step, world_size, exp)
    merged: dict[str, set[int]] = {}
    for lines in per_rank:
        for name, numbers in lines.items():
            merged.setdefault(name, set()).update(numbers)
    return {name: sorted(numbers) for name, numbers in sorted(merged.items())}

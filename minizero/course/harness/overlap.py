"""Overlap as a structural fact of one backward, measured the same way by the suite and by the labs' checker.

Whether communication overlaps backward is a question of *when collectives are
submitted* and *where they run*, not of a stopwatch: a bucket's collective must
be handed to the communication thread while gradients are still to come, and
no collective may run on the main thread before backward ends (backward would
wait for it).  :func:`backward_launches` watches each synchronising backward of
a real training run and reports both; :func:`minizero.course.harness.costs.overlap_problem`
judges them.  (``tests/test_overlap.py`` also times it on a dialled network: the
structure is what the property holds; the timeline is what it buys.)
"""
from __future__ import annotations

import threading

import torch

from ...run.launch import Rank
from ...run.train import shard_step, train_step
from .experiment import build
from .tasks import TASKS


def backward_launches(me: Rank, exp) -> list[dict]:
    """Each synchronising backward of ``exp`` on this rank: how many gradients were final when each collective
    was *submitted* to the communication thread (``launches``), which collectives ran on the main thread during
    it (``blocking``), and how many gradients it had (``params``)."""
    stage, model, comm, _ = build(me, exp)
    params = [p for _, p in stage.trainable()]
    state = {"ready": 0, "in_backward": False, "launches": [], "blocking": []}
    main = threading.main_thread()

    def counted(param):
        state["ready"] += 1

    for p in params:
        p.register_post_accumulate_grad_hook(counted)

    def backward_starts(module, args, output):  # the output's gradient comes before any parameter's
        if output.requires_grad:  # (a micro-batch inside no_sync() counted its gradients too: start again)
            output.register_hook(lambda grad: state.update(in_backward=True, ready=0, launches=[], blocking=[]))

    model.register_forward_hook(backward_starts)
    submit = comm.submit

    def spied_submit(fn):
        if state["in_backward"]:
            state["launches"].append(state["ready"])
        return submit(fn)

    comm.submit = spied_submit
    for kind in ("all_reduce", "reduce_scatter", "all_gather"):
        original = getattr(comm, kind)

        def spied(*args, _original=original, _kind=kind, **kwargs):
            if state["in_backward"] and threading.current_thread() is main and not kwargs.get("async_op"):
                state["blocking"].append(_kind)
            return _original(*args, **kwargs)

        setattr(comm, kind, spied)
    post_backward = stage.post_backward
    seen = []

    def spied_post_backward():  # the end of a synchronising backward: what happened during it
        seen.append({"launches": list(state["launches"]), "blocking": list(state["blocking"]), "params": len(params)})
        state.update(ready=0, in_backward=False, launches=[], blocking=[])
        return post_backward()

    stage.post_backward = spied_post_backward
    task, n = TASKS[exp.task], me.world_size
    try:
        for s in range(exp.steps):
            x, y = task.make_batch(exp.global_batch(n), exp.seed, s, torch.float64 if exp.dtype == "float64"
                                   else torch.float32, **exp.model)
            train_step(stage, shard_step(x, y, me.rank, n, exp.accum))
    finally:
        comm.close()
    return seen

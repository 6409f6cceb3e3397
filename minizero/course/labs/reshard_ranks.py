"""What runs on each rank for the reshard lab: a ZeRO-1 run that saves its flat shards at N ranks, and a run at M
ranks that builds its shards from them with the learner's ``Reshard``, loads them and trains on.

Both halves train as the suite does (:func:`minizero.run.train.train_step` on the rank's share of one global batch,
the same global batch at N and at M), so the second half, step for step, must be the single-device run's
continuation.  A rank reports its own exception as a value, in the learner's words.
"""
from __future__ import annotations

import copy
from dataclasses import replace

from ...checkpoint.flat import FlatShard, load_flat_shards, save_flat_shards
from ...run.launch import Rank
from ...run.train import shard_step, train_step
from ..harness.equivalence import DTYPES
from ..harness.experiment import build, snapshot_parameters
from ..harness.result import RankResult
from ..harness.tasks import TASKS
from .loading import Impl
from .raised import Raised
from .yours import probe


def _train(me: Rank, exp, stage, model) -> RankResult:
    """``exp.steps`` steps from ``exp.first_step``: every parameter and the consolidated optimizer state after each."""
    task, n = TASKS[exp.task], me.world_size
    params, losses, states = [], [], []
    for s in range(exp.first_step, exp.first_step + exp.steps):
        x, y = task.make_batch(exp.global_batch(n), exp.seed, s, DTYPES[exp.dtype], **exp.model)
        losses.append(train_step(stage, shard_step(x, y, me.rank, n, exp.accum, list(exp.rank_sizes))))
        params.append(snapshot_parameters(stage, model))
        states.append(copy.deepcopy(stage.full_optimizer_state_dict()))
    return RankResult(params=params, losses=losses, optimizer_states=states)


def save_run(me: Rank, exp) -> list[FlatShard]:
    """The package's ZeRO-1 trains ``exp`` at this world size; this rank's flat shards after its last step."""
    stage, model, comm, _ = build(me, exp)
    try:
        _train(me, exp, stage, model)
        return save_flat_shards(stage)
    finally:
        comm.close()


def resume_run(me: Rank, impl: Impl, exp, saved: list[list[FlatShard]], train: bool = True) -> dict | Raised:
    """A fresh ZeRO-1 at this world size takes the shards the learner's ``Reshard`` builds for this rank from
    ``saved`` (``saved[k]``: the N ranks' rank k's shards), then -- if ``train`` -- trains ``exp``.  Returns this
    rank's shards and, when trained, its :class:`RankResult`."""
    try:
        stage, model, comm, _ = build(me, exp)
        try:
            mine = impl.cls()().reshard_all(saved, me.world_size, me.rank)
            shards = [FlatShard(s.rank, s.world_size, s.numel, s.values.detach().clone(),
                                {k: v.detach().clone() for k, v in s.state.items()}) for s in mine]
            if not train:
                return {"shards": shards}
            load_flat_shards(stage, mine)
            return {"shards": shards, "result": _train(me, exp, stage, model)}
        finally:
            comm.close()
    except Exception as error:  # noqa: BLE001 -- reported to the learner, in words
        return Raised.now(me.rank, error, impl.path)


def yours_reshard(me: Rank, impl: Impl, exp, saved: list[list[FlatShard]]) -> list[str] | Raised | None:
    """The reshard lab's "your methods are what runs": each ``Reshard`` method of the lab written in the learner's
    file, and each called while this rank builds its shards (:func:`minizero.course.labs.ranks.yours_run`'s words);
    None when the reshard raised (the properties report it)."""
    return probe(me.rank, impl, lambda: resume_run(me, impl, replace(exp, steps=0), saved, train=False),
                 lambda never: "while a rank builds its shards: does your reshard call it?")

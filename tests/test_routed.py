"""Which parameters were used, across ranks and micro-batches (issue 45): on the routed model (each sample takes
one of two branches by its own first feature) a branch is used by some micro-batches of some ranks only -- or by
none in a step.  One device uses a branch if any sample of the global batch chose it; every stage that agrees on
use (``find_unused_parameters``) must give it that gradient, and leave a branch nobody chose unstepped.  A rank's
own record, or one kept only while synchronising, passes every model whose use is the same everywhere."""
from __future__ import annotations

import pytest
import torch

from minizero.course.harness.experiment import Experiment
from minizero.course.harness.tasks import TASKS
from minizero.run.train import shard_step
from tests.equivalence import run_and_check

#: The stages that agree on use across ranks.
STAGES = ("ddp", "ddp-bucketed", "zero1", "zero2", "zero3", "zeropp", "hsdp", "ps")
#: Three optimizer steps of K = 3 single-sample micro-batches on N = 3 ranks, at a seed whose branches are used
#: unevenly (the first test says how).
CASE = {"task": "routed", "optimizer": "momentum", "lr": 0.05, "steps": 3, "accum": 3, "micro_batch": 1,
        "dtype": "float64", "seed": 19, "options": {"find_unused_parameters": True}}


def _chose_left(world_size: int, step: int) -> list[list[bool]]:
    """Per rank, per micro-batch: did any sample take the left branch (else only the right)?"""
    x, y = TASKS["routed"].make_batch(CASE["micro_batch"] * CASE["accum"] * world_size, CASE["seed"], step,
                                      torch.float64)
    return [[bool((xs[:, 0] > 0.5).any()) for xs, _ in shard_step(x, y, r, world_size, CASE["accum"]).micro_batches]
            for r in range(world_size)]


def test_the_case_uses_its_branches_unevenly():
    """The case exists to differ: a micro-batch without the left branch beside one with it, on one rank and across
    ranks; a step in which no sample anywhere goes left; one in which only micro-batches inside no_sync() do."""
    seen = [_chose_left(3, step) for step in range(CASE["steps"])]
    flat = [c for step in seen for rank in step for c in rank]
    assert any(flat) and not all(flat), seen
    assert any(len({c for c in rank}) == 2 for step in seen for rank in step), seen  # differs by micro-batch
    assert any(len({any(rank) for rank in step}) == 2 for step in seen), seen  # differs by rank, within a step
    assert any(not any(c for rank in step for c in rank) for step in seen), seen  # a step no sample went left
    # a step whose left branch only micro-batches inside no_sync() took (torch's idiom: the last one synchronises)
    assert any(any(rank[0] or rank[1] for rank in step) and not any(rank[2] for rank in step) for step in seen), seen


@pytest.mark.parametrize("syncs", [None, (True, False, True)])
@pytest.mark.parametrize("stage", STAGES)
def test_a_branch_used_somewhere_gets_its_gradient_everywhere(pools, stage, syncs):
    exp = Experiment(stage=stage, syncs=syncs, **CASE)
    run_and_check(pools, exp, 3)


@pytest.mark.parametrize("stage", ["ddp", "zero2", "zero3"])
def test_a_branch_used_nowhere_in_a_step_is_not_stepped(pools, stage):
    """At N = 1 with one single-sample micro-batch, each step uses one branch: the other keeps no gradient and no
    momentum, as on one device (torch's optimizers skip a parameter whose .grad is None)."""
    exp = Experiment(stage=stage, **{**CASE, "accum": 1, "steps": 3})
    run_and_check(pools, exp, 1)

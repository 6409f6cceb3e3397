"""A stage that is done is freed: nothing the package registers keeps it, its model or its buffers alive.

torch keeps a parameter's post-accumulate-grad hooks in C++, where the garbage collector cannot see them; a hook
bound to the stage made stage -> model -> parameter -> hook -> stage a cycle nothing freed.  In a pool of ranks that
runs experiment after experiment (the property suite, ``compare``, ``bench all``, the labs' checker) every stage then
stayed alive with its buffers -- ``bench all --model large`` was killed for memory.
"""
from __future__ import annotations

import gc

import pytest
import torch

from minizero.course.harness.experiment import Experiment, run_experiment


def _live_tensors(me) -> int:
    gc.collect()
    return sum(isinstance(o, torch.Tensor) for o in gc.get_objects())


def _run_then_count(me, exp: Experiment) -> int:
    run_experiment(me, exp)
    return _live_tensors(me)


@pytest.mark.parametrize("stage", ["ddp-bucketed", "zero1", "zero2", "zero3", "ps"])
def test_a_finished_stage_leaves_nothing_alive(pools, stage):
    exp = Experiment(stage=stage, task="gpt", steps=1, dtype="float32", check=False)
    pools.run(2, _run_then_count, exp)  # warm: what earlier tests in this pool left may be freed during it
    second = pools.run(2, _run_then_count, exp)
    third = pools.run(2, _run_then_count, exp)  # one more run of the same stage: nothing more may stay alive
    assert all(t <= s for s, t in zip(second, third, strict=True)), (
        f"{stage}: live tensors per rank grew from {second} to {third} after one more run")

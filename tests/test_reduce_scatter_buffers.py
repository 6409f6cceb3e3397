"""ZeRO-2's and -3's ``reduce_scatter_buffers`` (FSDP2's ``set_reduce_scatter_max_input_buffers``): how many packed
buckets may wait for their reduce-scatter before backward packs the next.  The same training as single-device at
every bound; the bound itself, measured as the packed buffers alive at once on a slow wire, equal to the option."""
from __future__ import annotations

import weakref
from dataclasses import replace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from minizero.course.harness.experiment import Experiment, build
from minizero.course.harness.tasks import TASKS
from minizero.parts.layout import FlatGroup
from minizero.run.train import shard_step, train_step
from minizero.stages import STAGES
from tests.equivalence import covering, examples, experiments, run_and_check


def with_buffers(drawn, buffers):
    exp, world_size = drawn
    return replace(exp, options={**exp.options, "reduce_scatter_buffers": buffers}), world_size


@covering
@settings(max_examples=examples(24))
@given(drawn=st.one_of(experiments("zero2", max_accum=3), experiments("zero3", max_accum=3)),
       buffers=st.sampled_from([2, 3]))
def test_zero2_and_zero3_with_more_buffers_match_the_reference(pools, drawn, buffers):
    """World sizes 1-4, K up to 3, uneven batches, drawn bucket caps and units, frozen, tied and unused parameters,
    clipping, param groups: only when backward waits changes, never what is reduced."""
    run_and_check(pools, *with_buffers(drawn, buffers))


def packed_alive_on_rank(me, exp) -> int:
    """The most packed gradient buffers alive at once on this rank, counted each time one is packed."""
    alive, most, take = [], [0], FlatGroup.take_gradients

    def counted(group):
        full = take(group)
        alive.append(weakref.ref(full))
        most[0] = max(most[0], sum(ref() is not None for ref in alive))
        return full
    FlatGroup.take_gradients = counted
    try:
        stage, _, comm, _ = build(me, exp)
        try:
            for s in range(exp.steps):
                x, y = TASKS[exp.task].make_batch(exp.global_batch(me.world_size), exp.seed, s, torch.float32,
                                                     **exp.model)
                train_step(stage, shard_step(x, y, me.rank, me.world_size, exp.accum))
        finally:
            comm.close()
    finally:
        FlatGroup.take_gradients = take
    return most[0]


@pytest.mark.parametrize("stage", ["zero2", "zero3"])
def test_on_a_slow_wire_exactly_the_bound_of_packed_buckets_is_alive(pools, stage):
    """Every bucket's reduce-scatter takes 30 ms, far longer than backward takes to fill the next: backward waits
    at the bound, so the packed buffers alive at once are exactly ``reduce_scatter_buffers`` -- the memory
    :func:`~minizero.course.harness.backward_memory.backward_peak` counts.  Fails if the bound is ignored (all of
    them alive) or off by one."""
    # (ZeRO-3's units kept gathered after forward: a backward all-gather would queue behind the reduce-scatters and
    # drain them whatever the bound)
    options = {"bucket_mb": 1e-9} if stage == "zero2" else {"reshard_after_forward": False}
    exp = Experiment(stage=stage, task="gpt", model={"n_layer": 4}, steps=1, dtype="float32", optimizer="sgd",
                     check=False, network="alpha=30ms,bandwidth=10GB/s", options=options)
    for buffers in (1, 2, 3):
        most = pools.run(2, packed_alive_on_rank, replace(exp, options={**options, "reduce_scatter_buffers": buffers}))
        assert most == [buffers, buffers], (buffers, most)


def refusal_on_rank(me, stage, bad) -> str:
    from minizero.comm import make_comm
    comm = make_comm("ring")
    try:
        STAGES[stage](torch.nn.Linear(2, 2), comm=comm, reduce_scatter_buffers=bad)
    except ValueError as error:
        return str(error)
    finally:
        comm.close()
    return "accepted"


@pytest.mark.parametrize("stage", ["zero2", "zero3"])
def test_a_bound_that_is_not_a_count_is_refused(pools, stage):
    for bad in (0, -1, 1.5, "2", True):
        [said] = pools.run(1, refusal_on_rank, stage, bad)
        named, got, default = ("max_in_flight (ZeRO's reduce_scatter_buffers) must be a whole number >= 1 (or None: no bound), got",
                               f" {bad!r}", "; FSDP2's default is 1, one bucket in flight")
        assert said == named + got + default, (stage, bad, said)

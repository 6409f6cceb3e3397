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

from minizero.course.harness.experiment import Experiment
from minizero.parts.layout import FlatGroup
from minizero.stages import STAGES
from tests.equivalence import covering, examples, experiments, run_and_check, train_here


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
        train_here(me, exp)
    finally:
        FlatGroup.take_gradients = take
    return most[0]


@pytest.mark.parametrize("stage", ["zero2", "zero3"])
def test_on_a_slow_wire_exactly_the_bound_of_packed_buckets_is_alive(pools, stage):
    """Every bucket's reduce-scatter takes 30 ms, far longer than backward takes to fill the next: backward waits
    at the bound, so the packed buffers alive at once are exactly ``reduce_scatter_buffers`` -- the memory
    :func:`~minizero.course.harness.backward_memory.backward_peak` counts.  Fails if the bound is ignored (all of
    them alive) or off by one."""
    # (ZeRO-3's units kept gathered after forward: a backward all-gather would queue behind the reduce-scatters, and
    # waiting for it would drain all but the one queued after it -- 3 buffers would never show)
    options = {"bucket_mb": 1e-9} if stage == "zero2" else {"reshard_after_forward": False}
    exp = Experiment(stage=stage, task="gpt", model={"n_layer": 4}, steps=1, dtype="float32", optimizer="sgd",
                     check=False, network="alpha=30ms,bandwidth=10GB/s", options=options)
    for buffers in (1, 2, 3):
        most = pools.run(2, packed_alive_on_rank, replace(exp, options={**options, "reduce_scatter_buffers": buffers}))
        assert most == [buffers, buffers], (buffers, most)


def refusal_on_rank(me, stage, bad):
    """What constructing ``stage`` with ``reduce_scatter_buffers=bad`` raised, and whether the module was left whole."""
    from minizero.comm import make_comm
    comm, module = make_comm("ring"), torch.nn.Linear(2, 2)
    before = [p.detach().clone() for p in module.parameters()]
    try:
        STAGES[stage](module, comm=comm, reduce_scatter_buffers=bad)
        said = "accepted"
    except (TypeError, ValueError) as error:
        said = f"{type(error).__name__}: {error}"
    finally:
        comm.close()
    return said, all(p.untyped_storage().nbytes() and torch.equal(p, b) for p, b in zip(module.parameters(), before, strict=True))


@pytest.mark.parametrize("stage", ["zero2", "zero3", "hsdp", "zeropp"])
def test_a_bound_that_is_not_a_count_is_refused_before_anything_is_sharded(pools, stage):
    """As FSDP2's setter: a type error for what is not an int (None, which would mean no bound at all, and True
    included), a value error below 1 -- raised before the module's parameters are sharded, so nothing is lost."""
    for bad in (None, 1.5, "2", True):
        said, whole = pools.run(1, refusal_on_rank, stage, bad)[0]
        assert said == (f"TypeError: reduce_scatter_buffers must be a whole number (an int), got {bad!r} of type "
                        f"{type(bad).__name__} (FSDP2's default is 1)") and whole, (stage, bad, said, whole)
    for bad in (0, -1):
        said, whole = pools.run(1, refusal_on_rank, stage, bad)[0]
        assert said == (f"ValueError: reduce_scatter_buffers must be >= 1 packed bucket in flight, got {bad} (FSDP2's "
                        f"default is 1: backward waits for the one before)") and whole, (stage, bad, said, whole)


def test_the_memory_walk_counts_the_bound_of_packed_buckets():
    """:func:`~minizero.course.harness.backward_memory.backward_peak` through ``step_bytes`` (bench-gpt, N = 3, fp32
    AdamW, checkpointed): at one buffer the figures the walk gave before the bound was a parameter (ZeRO-2: one
    bucket of 1 MiB caps, 793,088 B; a 0.25 MiB cap, 262,144 B); each more buffer holds at least as much, at most one
    more bucket; a bound past the number of buckets changes nothing; a bound that is not a count is refused."""
    from minizero.course.commands.memory_table import gpt_shape
    from minizero.course.harness.step_memory import step_bytes
    shape = gpt_shape("bench-gpt")

    def buckets(stage, bucket_mb, buffers):
        return step_bytes(stage, 8e5, shape, 3, 8, "fp32", "adamw", True, foreach=False, bucket_mb=bucket_mb,
                          reduce_scatter_buffers=buffers)["buckets"]
    assert buckets("zero2", 1.0, 1) == 793_088 and buckets("zero2", 0.25, 1) == 262_144
    for stage in ("zero2", "zero3"):
        for bucket_mb in (0.25, 1.0):
            held = [buckets(stage, bucket_mb, b) for b in (1, 2, 3, 50, 100)]
            steps = [more - less for less, more in zip(held[:2], held[1:3], strict=True)]  # from 1 to 2, 2 to 3
            # one more bucket each: the buckets' sizes differ by a few per cent from the one at the peak
            assert all(0 <= step <= 1.05 * held[0] for step in steps) and held[1] > held[0], (stage, bucket_mb, held)
            assert held[2] <= held[3] == held[4], (stage, bucket_mb, held)
    for bad in (0, True, None):
        with pytest.raises((TypeError, ValueError), match="reduce_scatter_buffers must be"):  # the stages' own check
            buckets("zero2", 1.0, bad)

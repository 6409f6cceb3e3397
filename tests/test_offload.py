"""Optimizer-state offload (:mod:`minizero.parts.offload`, ZeRO-Offload) on every ZeRO stage: the masters and the optimizer's
states of the owned shard in host memory, the step computed there.  It moves where the step happens, not what it
computes: offloaded training is the same training to the bit -- and the stages it is the same as are proven
equivalent to single-device training by the rest of the suite.  What it moves is measured: the device keeps what the
formula says (ZeRO-2 in 16 bits: 2Psi + 2Psi/N), the host the rest (12Psi/N), and each step copies the gradient shard
to the host and the updated parameters back, in the working dtype.  On this CPU-only machine host and device are the
same memory; the copies are still made, placed and counted."""
from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from minizero.course.harness.costs import memory_problem
from minizero.course.harness.experiment import Experiment, run_experiment
from minizero.course.harness.optimizers import STATE_TENSORS
from minizero.stages import STAGES, distributed, make_stage
from tests.equivalence import examples, experiments

#: The stages that take the option: the ZeRO family (each declares it).
OFFLOADING = [s for s in distributed() if "offload_optimizer" in STAGES[s].option_names()]


def offloaded(drawn):
    """Offload on, and two steps at least: the parameters a run reports after a step are the masters' values, so
    only the next step's losses show whether the working copy -- what the device computes with -- was written back."""
    exp, world_size = drawn
    return replace(exp, steps=max(exp.steps, 2), options={**exp.options, "offload_optimizer": True}), world_size


def assert_bit_equal(got, want, where: str) -> None:
    """Two nests of dicts, lists and tensors, equal to the bit (dtype included)."""
    if torch.is_tensor(want):
        assert torch.is_tensor(got) and got.dtype == want.dtype and torch.equal(got, want), where
    elif isinstance(want, dict):
        assert sorted(got, key=str) == sorted(want, key=str), (where, sorted(got, key=str), sorted(want, key=str))
        for k in want:
            assert_bit_equal(got[k], want[k], f"{where}[{k!r}]")
    elif isinstance(want, (list, tuple)):
        assert len(got) == len(want), where
        for i, (a, b) in enumerate(zip(got, want, strict=True)):
            assert_bit_equal(a, b, f"{where}[{i}]")
    else:
        assert got == want, (where, got, want)


def test_the_zero_stages_take_it():
    assert {"zero1", "zero2", "zero3", "hsdp"} <= set(OFFLOADING)


@pytest.mark.parametrize("stage", OFFLOADING)
def test_offloaded_training_is_the_same_training_to_the_bit(pools, stage):
    """fp32 and mixed precision (fp16's skipped steps included), the optimizer given at wrap time or built after
    over ``stage.parameters()`` (then the user's optimizer steps the host masters), accumulation, uneven shards,
    frozen, unused and tied parameters: every rank's losses, parameters after each step and consolidated optimizer
    state are those of the same run without offload."""
    @settings(max_examples=examples(4))
    @given(drawn=st.one_of(experiments(stage, max_accum=2, wrap_first=True),
                           experiments(stage, max_accum=2, wrap_first=True, precision=True)).map(offloaded))
    def prop(drawn):
        exp, n = drawn
        host = pools.run(n, run_experiment, exp)
        device = pools.run(n, run_experiment, replace(exp, options={**exp.options, "offload_optimizer": False}))
        for rank, (a, b) in enumerate(zip(device, host, strict=True)):
            assert b.losses == a.losses, (rank, a.losses, b.losses)
            assert b.skipped_steps == a.skipped_steps, rank
            assert_bit_equal(b.params, a.params, f"rank {rank} parameters")
            assert_bit_equal(b.optimizer_state, a.optimizer_state, f"rank {rank} optimizer state")
            assert b.host_copied["to_host"] > 0 or not any(b.sent_per_step), (rank, b.host_copied)
    prop()


@pytest.mark.parametrize("precision, working", [("fp32", 4), ("bf16", 2)])
@pytest.mark.parametrize("stage", OFFLOADING)
def test_device_and_host_hold_and_copy_what_the_formulas_say(pools, stage, precision, working):
    """The device keeps the stage's formula less the optimizer's K bytes, the host holds K Psi / N (the masters --
    in fp32 the shard's own host copy -- and Adam's two moments), and every step copies each rank's gradient shard
    to the host and its updated parameters back: over all ranks, Psi elements each way per replica, in the working
    dtype -- ZeRO-Offload's 2Psi/N bytes per rank each way, in 16 bits."""
    n, steps = (4, 2) if getattr(STAGES[stage], "needs_nodes", False) else (3, 2)
    exp = Experiment(stage=stage, task="gpt", steps=steps, accum=2, dtype="float32", optimizer="adamw",
                     options={"precision": precision, "offload_optimizer": True})
    results = pools.run(n, run_experiment, exp)
    psi, k = results[0].psi, STATE_TENSORS["adamw"]
    device = STAGES[stage].state_bytes(psi, n, 4, k, precision, offload_optimizer=True)
    host = STAGES[stage].host_state_bytes(psi, n, 4, k, precision, offload_optimizer=True)
    assert memory_problem(results, device) is None
    assert host == pytest.approx(12 * psi / STAGES[stage].shard_count(n))
    for rank, r in enumerate(results):
        assert r.held_bytes["host"] == pytest.approx(host, rel=0.02), (rank, r.held_bytes, host)
        assert r.held_bytes["total"] + r.held_bytes["host"] > STAGES[stage].state_bytes(psi, n, 4, k, precision)
    replicas = n // STAGES[stage].shard_count(n)
    for way in ("to_host", "to_device"):
        assert sum(r.host_copied[way] for r in results) == steps * psi * working * replicas, way


def test_offload_takes_a_switch_and_refuses_anything_else():
    model = torch.nn.Linear(2, 2)
    with pytest.raises(TypeError, match=r"rank 0: offload_optimizer must be True or False .* got 'cpu'"):
        make_stage("zero2", model, torch.optim.Adam(model.parameters()), comm=None, offload_optimizer="cpu")

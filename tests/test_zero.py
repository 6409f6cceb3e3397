"""ZeRO-1 and ZeRO-2: the same training as a single device, in less memory, for DDP's bytes."""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from minizero.comm import make_comm
from minizero.course.harness.costs import bytes_problem, memory_problem
from minizero.course.harness.experiment import Experiment, reference_of, run_experiment
from minizero.course.harness.models import MLP, EdgeModel
from minizero.run.launch import RankError
from minizero.stages import STAGES, make_stage
from tests.equivalence import assert_same_optimizer_state, covering, examples, experiments, run_and_check


@pytest.mark.parametrize("stage", ["zero1", "zero2"])
@covering
@settings(max_examples=examples(28))
@given(data=st.data())
def test_zero_matches_reference(pools, stage, data):
    exp, world_size = data.draw(experiments(stage, max_accum=4, wrap_first=True))
    run_and_check(pools, exp, world_size)


@pytest.mark.parametrize("stage", ["zero1", "zero2"])
@pytest.mark.parametrize("task, model, dtype", [("mixed", {}, "float32"), ("dyadic", {"sizes": (1, 1)}, "float64"),
                                                ("edge", {"with_unused": False}, "float64")])
def test_mixed_dtypes_tiny_models_and_edge_parameters(pools, stage, task, model, dtype):
    """Groups split by dtype; 2 elements on 4 ranks (shards of padding); frozen, tied, zero-size."""
    exp = Experiment(stage=stage, task=task, model=model, optimizer="adamw", steps=3, accum=2, dtype=dtype,
                     param_groups=True, record_states=True, clip=(0.1, 2.0))
    run_and_check(pools, exp, 4)


def check_zero_bytes(pools, stage: str, world_size: int, stages: dict | None = None) -> None:
    """The ledger: a reduce-scatter and an all-gather, no all-reduce -- 2(N-1)/N Psi b, up to padding."""
    exp = Experiment(stage=stage, task="gpt", steps=2, accum=2, dtype="float32", stages=stages)
    results = pools.run(world_size, run_experiment, exp)
    sent = sum(r.sent_bytes for r in results) / (world_size * exp.steps)
    formula = STAGES["zero1"].sent_bytes_per_step(results[0].psi, world_size, 4, 4)
    assert formula <= sent <= formula + 2 * (world_size - 1) * 4 * 30, (sent, formula)  # padding: < N per group
    assert bytes_problem(results, formula, {"reduce_scatter", "all_gather"}) is None  # each rank, each step


@pytest.mark.parametrize("world_size", [2, 3, 4])
@pytest.mark.parametrize("stage", ["zero1", "zero2"])
def test_bytes_are_ddps_and_travel_as_reduce_scatter_plus_all_gather(pools, stage, world_size):
    check_zero_bytes(pools, stage, world_size)


@pytest.mark.parametrize("world_size", [2, 3, 4])
@pytest.mark.parametrize("stage", ["ddp", "ddp-bucketed", "zero1", "zero2"])
def test_measured_memory_matches_the_formula(pools, world_size, stage):
    exp = Experiment(stage=stage, task="gpt", steps=1, dtype="float32", optimizer="adamw")
    results = pools.run(world_size, run_experiment, exp)
    formula = STAGES[stage].state_bytes(results[0].psi, world_size, 4, 2)
    assert memory_problem(results, formula) is None


def test_memory_shrinks_as_the_paper_says(pools):
    held = {s: pools.run(4, run_experiment, Experiment(stage=s, task="gpt", steps=1, dtype="float32"))[0]
            .held_bytes for s in ("ddp", "zero1", "zero2")}
    assert held["zero1"]["optimizer"] * 4 <= held["ddp"]["optimizer"] * 1.01
    assert held["zero2"]["grads"] * 4 <= held["ddp"]["grads"] * 1.01
    assert held["ddp"]["total"] > held["zero1"]["total"] > held["zero2"]["total"]


def _consolidated_loads_into_plain_optimizer(me, stage):
    exp = Experiment(stage=stage, task="mlp", optimizer="adamw", steps=2, dtype="float64", param_groups=True)
    result = run_experiment(me, exp)
    model = MLP(**exp.model, dtype=torch.float64)
    from minizero.course.harness.optimizers import make_optimizer
    plain = make_optimizer("adamw", model, exp.lr, param_groups=True)
    plain.load_state_dict(result.optimizer_state)
    return plain.state_dict()


@pytest.mark.parametrize("stage", ["zero1", "zero2"])
def test_consolidated_state_dict_loads_into_a_plain_optimizer(pools, stage):
    loaded = pools.run(3, _consolidated_loads_into_plain_optimizer, stage)[0]
    exp = Experiment(stage=stage, task="mlp", optimizer="adamw", steps=2, dtype="float64", param_groups=True)
    assert_same_optimizer_state(loaded, reference_of(exp, 3).optimizer_state, 1e-9, "after 2 steps")


def _layout_facts(me):
    model = MLP((8, 16, 4), seed=me.rank)
    stage = make_stage("zero1", model, torch.optim.Adam(model.parameters()), make_comm("ring"))
    group = stage.groups[0]
    lo, hi = group.data.data_ptr(), group.data.data_ptr() + group.data.numel() * 4
    params_are_views = all(lo <= p.data_ptr() < hi for p in model.parameters())
    shard_is_view = group.shard.data_ptr() == lo + me.rank * group.shard_size * 4
    per_rank = stage.shard_optimizer_state_dict()
    return params_are_views, shard_is_view, group.shard_size, group.padding, len(per_rank["param_groups"])


def test_parameters_and_shards_are_views_into_the_flat_buffer(pools):
    for params_are_views, shard_is_view, shard_size, padding, n_groups in pools.run(3, _layout_facts):
        assert params_are_views and shard_is_view
        assert shard_size == 71 and padding == 1  # 212 parameters, padded to 213 = 3 x 71
        assert n_groups == 1


def _wrap_with(me, optimizer_name):
    model = MLP((4, 4))
    optimizer = {"lbfgs": lambda: torch.optim.LBFGS(model.parameters()),
                 "adafactor": lambda: torch.optim.Adafactor(model.parameters())}[optimizer_name]()
    make_stage("zero1", model, optimizer, make_comm("ring"))


@pytest.mark.parametrize("optimizer", ["lbfgs", "adafactor"])
def test_optimizer_that_needs_shapes_is_refused(pools, optimizer):
    with pytest.raises(RankError, match="(?s)cannot run on flat shards.*Use one of: SGD, Adam, AdamW"):
        pools.run(2, _wrap_with, optimizer)


def _unused_parameter(me, stage):
    model = EdgeModel(seed=0, dtype=torch.float64)
    zero = make_stage(stage, model, torch.optim.Adam(model.parameters()), make_comm("ring"))
    zero(torch.randn(2, 6, dtype=torch.float64)).sum().backward()


@pytest.mark.parametrize("stage", ["zero1", "zero2"])
def test_unused_parameter_is_named(pools, stage):
    with pytest.raises(RankError, match=r"parameter\(s\) \['unused'\] got no gradient.*requires_grad_\(False\)"):
        pools.run(2, _unused_parameter, stage)


def test_zero2_bucket_mb_must_be_positive(pools):
    from minizero.stages import ZeRO2
    with pytest.raises(ValueError, match="bucket_mb must be a finite number > 0"):
        ZeRO2(MLP(), torch.optim.SGD(MLP().parameters(), lr=0.1), None, bucket_mb=0)


def _consolidated_after_a_schedule(me):
    model = MLP((4, 4), seed=0)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    stage = make_stage("zero2", model, optimizer, make_comm("ring"))
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.1)
    for s in range(2):
        stage.zero_grad()
        stage(torch.randn(2, 4)).sum().backward()
        stage.step()
        scheduler.step()
    return stage.full_optimizer_state_dict()["param_groups"][0], optimizer.param_groups[0]["lr"]


def test_the_consolidated_state_carries_the_current_hyper_parameters(pools):
    """After a learning-rate schedule the state_dict has today's lr and the scheduler's initial_lr --
    loading it must not reset the schedule."""
    for group, lr in pools.run(2, _consolidated_after_a_schedule):
        assert group["lr"] == lr and abs(lr - 1e-4) < 1e-12 and group["initial_lr"] == 0.01

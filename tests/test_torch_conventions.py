"""A loop written for torch's DDP / FSDP2 just works: wrap first, build the optimizer over
``stage.parameters()``, step it yourself.  Under ZeRO each parameter is this rank's piece of it, with the
matching piece of the averaged gradient -- FSDP's ``use_orig_params`` -- so per-parameter code works too."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from minizero import ShardedOptimizer
from minizero.comm import make_comm
from minizero.run.launch import RankError
from minizero.stages import STAGES, make_stage
from tests.test_robustness import Branchy, _data

WORLD = 3
DISTRIBUTED = [n for n in STAGES if n != "reference" and STAGES[n].equivalent]  # (the others differ by design)
# A parameter server keeps its optimizer on the servers: it refuses one built afterwards (test_contrast_stages).
WRAP_FIRST = [n for n in DISTRIBUTED if n != "ps"]


def _torch_style(me, stage_name, steps=3):
    """As torch's documentation writes it: model, wrapper, *then* the optimizer over the wrapper's parameters."""
    model = Branchy()
    ddp_model = make_stage(stage_name, model, comm=make_comm("ring", check=True))
    optimizer = torch.optim.AdamW(ddp_model.parameters(), lr=0.01, weight_decay=0.1)
    for step in range(steps):
        optimizer.zero_grad()
        loss = ddp_model(_data(me.rank, step)).pow(2).mean()
        loss.backward()
        optimizer.step()
    return _full(model, ddp_model)


def _full(model, stage) -> torch.Tensor:
    state = stage.full_state_dict()
    return torch.cat([state[n].reshape(-1) for n, _ in model.named_parameters()])


def _single_device(steps=3) -> torch.Tensor:
    model = Branchy()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01, weight_decay=0.1)
    for step in range(steps):
        optimizer.zero_grad()
        loss = sum(model(_data(r, step)).pow(2).mean() for r in range(WORLD)) / WORLD
        loss.backward()
        optimizer.step()
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


@pytest.mark.parametrize("stage", WRAP_FIRST)
def test_a_loop_written_for_torch_trains_every_stage_like_one_device(pools, stage):
    want = _single_device()
    for got in pools.run(WORLD, _torch_style, stage):
        assert torch.allclose(got, want, rtol=0, atol=1e-12), (got - want).abs().max()


def _pieces(me, stage_name):
    model = Branchy()
    stage = make_stage(stage_name, model, comm=make_comm("ring"))
    stage(_data(me.rank, 0)).pow(2).mean().backward()
    return {name: (p.detach().clone(), None if p.grad is None else p.grad.clone())
            for name, p in stage.named_parameters()}


@pytest.mark.parametrize("stage", ["zero1", "zero2", "zero3"])
def test_under_zero_each_parameter_is_this_ranks_piece_with_its_piece_of_the_averaged_gradient(pools, stage):
    model = Branchy()
    loss = sum(model(_data(r, 0)).pow(2).mean() for r in range(WORLD)) / WORLD
    loss.backward()
    per_rank = pools.run(WORLD, _pieces, stage)
    for name, p in model.named_parameters():
        # (a rank that owns none of a parameter holds an empty piece of it, as a DTensor's empty local shard)
        value = torch.cat([r[name][0] for r in per_rank])
        grad = torch.cat([r[name][1] for r in per_rank if r[name][0].numel()])
        assert torch.equal(value, p.detach().reshape(-1)), name  # the pieces tile the parameter, in rank order
        assert torch.allclose(grad, p.grad.reshape(-1), rtol=0, atol=1e-14), name


def test_a_stage_is_an_nn_module_whose_state_dict_is_the_models():
    model = Branchy()
    stage = make_stage("reference", model)
    assert isinstance(stage, nn.Module)
    assert [n for n, _ in stage.named_parameters()] == [f"module.{n}" for n, _ in model.named_parameters()]
    assert set(stage.state_dict()) == {f"module.{k}" for k in model.state_dict()}  # as torch DDP's


def _sharded_optimizer_alone(me):
    """torch's ZeroRedundancyOptimizer calling convention, after a ddp stage averaged the gradients."""
    model = Branchy()
    comm = make_comm("ring")
    ddp_model = make_stage("ddp", model, comm=comm)
    optimizer = ShardedOptimizer(ddp_model.parameters(), torch.optim.AdamW, comm=comm, lr=0.01, weight_decay=0.1)
    for step in range(3):
        optimizer.zero_grad()
        ddp_model(_data(me.rank, step)).pow(2).mean().backward()
        optimizer.step()
    owned = sum(len(state) > 0 for state in optimizer.local.state.values())
    return _full(model, ddp_model), owned, optimizer.full_state_dict()


def test_the_sharded_optimizer_alone_is_zero_redundancy_optimizer(pools):
    want = _single_device()
    results = pools.run(WORLD, _sharded_optimizer_alone)
    for got, _, _ in results:
        assert torch.allclose(got, want, rtol=0, atol=1e-12), (got - want).abs().max()
    assert sum(owned for _, owned, _ in results) < 2 * len(list(Branchy().parameters()))  # states are sharded
    assert set(results[0][2]["state"]) == set(range(len(list(Branchy().parameters()))))  # consolidated: all


def _step_without_optimizer(me):
    stage = make_stage("zero2", Branchy(), comm=make_comm("ring"))
    stage(_data(me.rank, 0)).pow(2).mean().backward()
    stage.step()


def test_stage_step_without_an_optimizer_names_the_fix(pools):
    fix = r"Call step\(\) on the optimizer you built over stage.parameters\(\)"
    with pytest.raises(RankError, match=r"needs the optimizer the stage was wrapped with.*" + fix):
        pools.run(2, _step_without_optimizer)


def test_an_option_the_stage_does_not_take_is_named_with_the_ones_it_does():
    with pytest.raises(TypeError, match=r"stage 'ddp' takes no option\(s\) \['bucket_mb'\]; its options: compress, "
                                        r"error_feedback, find_unused_parameters"):
        make_stage("ddp", Branchy(), bucket_mb=1)


def _zero_grad_after_forward(me, stage_name, wrap_first):
    """Legal torch orders that a stage must not get wrong: zero_grad() between forward and backward, and an
    evaluation forward between backward and step."""
    model = Branchy()
    if wrap_first:
        stage = make_stage(stage_name, model, comm=make_comm("ring", check=True))
        optimizer = torch.optim.AdamW(stage.parameters(), lr=0.01, weight_decay=0.1)
    else:
        optimizer = torch.optim.AdamW(model.parameters(), lr=0.01, weight_decay=0.1)
        stage = make_stage(stage_name, model, optimizer, make_comm("ring", check=True))
    for step in range(3):
        out = stage(_data(me.rank, step))
        optimizer.zero_grad()
        out.pow(2).mean().backward()
        with torch.no_grad():
            stage(_data(me.rank, step))
        optimizer.step()
    return _full(model, stage)


@pytest.mark.parametrize("stage, wrap_first", [(s, w) for s in DISTRIBUTED for w in (True, False)
                                                if s in WRAP_FIRST or not w])
def test_zero_grad_after_forward_and_an_evaluation_before_step_change_nothing(pools, stage, wrap_first):
    want = _single_device()
    for got in pools.run(WORLD, _zero_grad_after_forward, stage, wrap_first):
        assert torch.allclose(got, want, rtol=0, atol=1e-12), (got - want).abs().max()

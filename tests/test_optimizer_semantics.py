"""Optimizer semantics equal torch's, on every stage.

Whichever ``zero_grad`` the user calls (the stage's, their optimizer's, the
sharded one's; ``set_to_none`` or not), a step with no backward, gradients
never cleared between steps, a parameter without a gradient: each stage must
end where a plain torch model and optimizer on one device end -- or refuse,
naming the fix.  AdamW with weight decay makes "stepped with a zero gradient"
visible: decay moves the weights, and Adam's step count changes.
"""
from __future__ import annotations

import contextlib

import pytest
import torch

from minizero.comm import make_comm
from minizero.run.launch import RankError
from minizero.stages import make_stage
from tests.test_robustness import Branchy  # a, b, c: c used or not, per call

STAGES = ["ddp", "ddp-bucketed", "zero1", "zero2", "zero3"]
WORLD = 2


def _data(rank, step):
    return torch.randn(8, 4, generator=torch.Generator().manual_seed(100 * step + rank), dtype=torch.float64)


def _loop(model, stage, clear, rank_of, scenario, world_size):
    """The scenario's training loop, run by a stage (``rank_of`` its rank) or by the reference (None)."""
    for s in range(3):
        if scenario != "never zeroed" or s == 0:
            clear(s)
        if scenario == "no backward" and s == 2:
            stage.step()  # zero_grad() then step(): nothing has a gradient, nothing may move
            continue
        ranks = range(world_size) if rank_of is None else [rank_of]
        for r in ranks:
            use_c = scenario != "c unused" and not (scenario.startswith("c on rank ") and r != int(scenario[-1])) \
                and not (scenario == "c in step 0 only" and s > 0)
            loss = stage(_data(r, s), use_c=use_c).pow(2).mean() / (world_size if rank_of is None else 1)
            loss.backward()
        stage.step()
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


class _Plain:
    """The reference driven like a stage."""

    def __init__(self, model, optimizer):
        self.model, self.optimizer = model, optimizer

    def __call__(self, *args, **kwargs):
        return self.model(*args, **kwargs)

    def step(self):
        self.optimizer.step()


def reference(clear_kind: str, scenario: str) -> torch.Tensor:
    model = Branchy()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01, weight_decay=0.1)
    set_to_none = not clear_kind.endswith("(set_to_none=False)")
    return _loop(model, _Plain(model, optimizer), lambda s: optimizer.zero_grad(set_to_none=set_to_none),
                 None, scenario, WORLD)


def _on_rank(me, stage_name, clear_kind, scenario):
    model = Branchy()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01, weight_decay=0.1)
    options = {"find_unused_parameters": True} if "c " in scenario else {}
    stage = make_stage(stage_name, model, optimizer, make_comm("ring", check=True), **options)
    set_to_none = not clear_kind.endswith("(set_to_none=False)")
    whom = {"stage": stage, "user": optimizer, "sharded": stage.optimizer, "model": model}[clear_kind.split(".")[0]]
    final = _loop(model, stage, lambda s: whom.zero_grad(set_to_none=set_to_none), me.rank, scenario, WORLD)
    if stage_name == "zero3":  # the model holds placeholders between uses: its state dict gathers them
        state = stage.full_state_dict()
        final = torch.cat([state[n].reshape(-1) for n, _ in model.named_parameters()])
    return final  # everyone else: straight from the module, as a user reads it after step() -- a stage that left
    # its full parameters stale there (all-gathered before the step) shows; its state dict reads the shards


# model.zero_grad(): a loop written for FSDP2 or DDP clears the model's gradients -- under ZeRO it used to leave
# the pieces' (what the optimizer steps) in place, and the steps added up silently.
CLEARS = ["stage.zero_grad()", "stage.zero_grad(set_to_none=False)", "user.zero_grad()",
          "user.zero_grad(set_to_none=False)", "sharded.zero_grad()", "model.zero_grad()",
          "model.zero_grad(set_to_none=False)"]


@pytest.mark.parametrize("clear", CLEARS)
@pytest.mark.parametrize("stage", STAGES)
def test_whichever_zero_grad_the_user_calls_training_equals_torch(pools, stage, clear):
    if clear.startswith("sharded") and not stage.startswith("zero"):
        pytest.skip("only ZeRO stages have an optimizer of their own")
    for scenario in ("train", "no backward"):
        want = reference(clear, scenario)
        for rank, got in enumerate(pools.run(WORLD, _on_rank, stage, clear, scenario)):
            assert torch.allclose(got, want, rtol=0, atol=1e-12), \
                f"{scenario}, rank {rank}: |Δ| = {(got - want).abs().max():.3g}"


@pytest.mark.parametrize("stage", STAGES)
def test_step_without_backward_moves_nothing(pools, stage):
    """zero_grad() then step(): torch skips every parameter (no decay, no Adam step count)."""
    start = torch.cat([p.detach().reshape(-1) for p in Branchy().parameters()])
    got = pools.run(WORLD, _step_only, stage)
    assert all(torch.equal(g, start) for g in got)


def _step_only(me, stage_name):
    model = Branchy()
    stage = make_stage(stage_name, model, torch.optim.AdamW(model.parameters(), lr=0.1, weight_decay=0.5),
                       make_comm("ring", check=True))
    stage.zero_grad()
    stage.step()
    stage.step()
    if hasattr(stage, "full_state_dict"):
        state = stage.full_state_dict()
        return torch.cat([state[n].reshape(-1) for n, _ in model.named_parameters()])
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


@pytest.mark.parametrize("clear", ["stage.zero_grad()", "stage.zero_grad(set_to_none=False)"])
@pytest.mark.parametrize("scenario", ["c unused", "c on rank 0", "c on rank 1"])  # each rank's shard may hold c
@pytest.mark.parametrize("stage", STAGES)
def test_a_parameter_without_a_gradient_is_not_stepped(pools, stage, scenario, clear):
    """With find_unused_parameters: unused everywhere -- not stepped (weight decay would move it), also
    after zero_grad(set_to_none=False), which zeroes gradients that exist and leaves a None a None;
    used on one rank only -- averaged with the other's zeros, as one device computes it (on either rank: which
    rank's shard holds c depends on the layout, and the rank that did not use it must still step its part)."""
    want = reference(clear, scenario)
    for got in pools.run(WORLD, _on_rank, stage, clear, scenario):
        assert torch.allclose(got, want, rtol=0, atol=1e-12), (got - want).abs().max()


@pytest.mark.parametrize("stage", STAGES)
def test_gradients_never_cleared_accumulate_across_steps_as_in_torch(pools, stage):
    want = reference("stage.zero_grad()", "never zeroed")
    for got in pools.run(WORLD, _on_rank, stage, "stage.zero_grad()", "never zeroed"):
        assert torch.allclose(got, want, rtol=0, atol=1e-12), (got - want).abs().max()


def _step_after_no_sync_only(me, stage_name):
    model = Branchy()
    stage = make_stage(stage_name, model, torch.optim.SGD(model.parameters(), lr=0.1), make_comm("ring", check=True))
    stage.zero_grad()
    with stage.no_sync():
        stage(_data(me.rank, 0)).pow(2).mean().backward()
    stage.step()


@pytest.mark.parametrize("stage", STAGES)
def test_step_after_no_sync_only_is_refused(pools, stage):
    """torch DDP steps on the local gradients and the replicas drift apart silently; minizero refuses."""
    with pytest.raises(RankError, match="step\\(\\) after backward passes inside no_sync\\(\\) only"):
        pools.run(WORLD, _step_after_no_sync_only, stage)


def _no_sync_then_sync(me, stage_name):
    """The legal pattern the refusal must not catch: accumulate, then synchronise, then step."""
    model = Branchy()
    stage = make_stage(stage_name, model, torch.optim.SGD(model.parameters(), lr=0.1), make_comm("ring", check=True))
    stage.zero_grad()
    for k in range(2):
        with stage.no_sync() if k == 0 else contextlib.nullcontext():
            stage(_data(me.rank, k)).pow(2).mean().backward()
    stage.step()
    return "stepped"


@pytest.mark.parametrize("stage", STAGES)
def test_accumulate_then_synchronise_still_steps(pools, stage):
    assert pools.run(WORLD, _no_sync_then_sync, stage) == ["stepped"] * WORLD


@pytest.mark.parametrize("clear", ["stage.zero_grad()", "user.zero_grad()", "user.zero_grad(set_to_none=False)"])
@pytest.mark.parametrize("stage", STAGES)
def test_a_parameter_that_stops_getting_gradients_stops_moving(pools, stage, clear):
    """c gets a gradient in step 0 only; after the user's own zero_grad() (routed to the stage) it is not
    stepped again -- unless set_to_none=False left it a zero gradient, which torch steps too."""
    want = reference(clear, "c in step 0 only")
    for got in pools.run(WORLD, _on_rank, stage, clear, "c in step 0 only"):
        assert torch.allclose(got, want, rtol=0, atol=1e-12), (got - want).abs().max()


def _users_own_step(me, stage_name):
    model = Branchy()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01, weight_decay=0.1)
    stage = make_stage(stage_name, model, optimizer, make_comm("ring", check=True))
    for s in range(3):
        optimizer.zero_grad()
        stage(_data(me.rank, s)).pow(2).mean().backward()
        optimizer.step()  # the user's own step, not the stage's: routed to the stage
    if hasattr(stage, "full_state_dict"):
        state = stage.full_state_dict()
        return torch.cat([state[n].reshape(-1) for n, _ in model.named_parameters()])
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


@pytest.mark.parametrize("stage", STAGES)
def test_the_users_own_optimizer_step_is_the_stages(pools, stage):
    """Under ZeRO the user's optimizer holds the unsharded parameters: its own step would update them with
    local, unreduced gradients and skip the all-gather -- silently.  It is routed to the stage's step."""
    want = reference("user.zero_grad()", "train")
    for got in pools.run(WORLD, _users_own_step, stage):
        assert torch.allclose(got, want, rtol=0, atol=1e-12), (got - want).abs().max()

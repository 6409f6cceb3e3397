"""Bad input gets a clear error that names the rank, the thing and the fix."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from minizero.comm import make_comm
from minizero.run.launch import RankError
from minizero.run.train import shard_step
from minizero.stages import make_stage


def _wrap_mismatched(me, what):
    torch.manual_seed(me.rank)
    layers = [nn.Linear(4, 4), nn.Linear(4, 2)]
    if me.rank == 1:
        if what == "shape":
            layers[1] = nn.Linear(4, 3)
        elif what == "dtype":
            layers[1] = layers[1].double()
        elif what == "name":
            layers.append(nn.Identity())
            layers[0], layers[2] = layers[2], layers[0]
        elif what == "frozen":
            layers[1].bias.requires_grad_(False)
    model = nn.Sequential(*layers)
    comm = make_comm("ring")
    make_stage("ddp", model, torch.optim.SGD(model.parameters(), lr=0.1), comm)
    return "wrapped"


@pytest.mark.parametrize("what, culprit", [("shape", "#2: here param 1.weight"), ("dtype", "#2: here param 1.weight"),
                                           ("name", "#0: here param"), ("frozen", "#3: here param 1.bias")])
def test_model_differing_across_ranks_is_named(pools, what, culprit):
    """Whichever rank's error arrives first names the parameter and who differs."""
    with pytest.raises(RankError) as info:
        pools.run(3, _wrap_mismatched, what)
    message = str(info.value)
    assert "differs across ranks at wrap time" in message and culprit in message
    assert "rank 1: the model differs" in message or "ranks [1] have something else" in message
    assert "only values may differ" in message


def _message_on_rank_1(me, what):
    try:
        _wrap_mismatched(me, what)
    except ValueError as error:
        return str(error)
    return None


def test_every_rank_names_the_first_differing_parameter(pools):
    messages = pools.run(3, _message_on_rank_1, "shape")
    assert "here param 1.weight (3, 4)" in messages[1] and "ranks [0, 2]" in messages[1]
    assert "here param 1.weight (2, 4)" in messages[0] and "ranks [1]" in messages[0]


def test_same_structure_different_values_is_fine(pools):
    assert pools.run(3, _wrap_mismatched, "none") == ["wrapped"] * 3


def test_uneven_batch_is_refused_unless_sizes_are_given():
    x, y = torch.zeros(7, 2), torch.zeros(7, 1)
    with pytest.raises(ValueError, match="does not split evenly over 3 ranks; pass rank_sizes"):
        shard_step(x, y, 0, 3)
    step = shard_step(x, y, 2, 3, accum_steps=2, rank_sizes=[3, 3, 1])
    assert [mb[0].shape[0] for mb in step.micro_batches] == [1, 0] and step.global_count == 7
    with pytest.raises(ValueError, match="summing to the global batch"):
        shard_step(x, y, 0, 3, rank_sizes=[3, 3, 3])


def test_stage_without_comm_is_refused():
    model = nn.Linear(2, 2)
    with pytest.raises(ValueError, match="pass a Comm"):
        make_stage("ddp", model, torch.optim.SGD(model.parameters(), lr=0.1))


STAGES = ["ddp", "ddp-bucketed", "zero1", "zero2", "zero3"]


class TwoHeads(nn.Module):
    """Rank-dependent control flow: which head a rank uses depends on its data."""

    def __init__(self, second_width=2):
        super().__init__()
        torch.manual_seed(0)
        self.trunk, self.b, self.c = nn.Linear(4, 8), nn.Linear(8, 2), nn.Linear(8, second_width)

    def forward(self, x, head):
        h = torch.tanh(self.trunk(x))
        return self.b(h) if head == "b" else self.c(h)[:, :2]


def _heads_per_rank(me, stage_name, second_width):
    model = TwoHeads(second_width)
    stage = make_stage(stage_name, model, torch.optim.SGD(model.parameters(), lr=0.1), make_comm("ring", check=True))
    stage(torch.randn(3, 4), "b" if me.rank == 0 else "c").sum().backward()


@pytest.mark.parametrize("second_width", [2, 3])  # same shapes: would pair b with c; different: gloo aborted
@pytest.mark.parametrize("stage", STAGES)
def test_parameters_used_on_some_ranks_only_are_named(pools, stage, second_width):
    """The old ddp packed whatever had a gradient: rank 0's b averaged with rank 1's c, no error.
    Now every stage refuses, naming the parameter; find_unused_parameters=True handles it exactly
    (tests/test_optimizer_semantics.py)."""
    with pytest.raises(RankError, match=r"parameter\(s\) \['(b|c)\.(weight|bias)', '(b|c)\.(weight|bias)'\] got no gradient.*"
                                        r"find_unused_parameters=True"):
        pools.run(2, _heads_per_rank, stage, second_width)


class Odd(nn.Module):
    """Layouts and dtypes that used to fail inside torch: channels_last and transposed weights, and
    BatchNorm's integer counter (the BatchNorm itself in eval mode, so training stays single-device math)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.conv = nn.Conv2d(2, 3, 3, padding=1).double().to(memory_format=torch.channels_last)
        self.bn = nn.BatchNorm2d(3).double().eval()
        self.lin = nn.Linear(12, 2).double()
        self.lin.weight.data = self.lin.weight.data.t().contiguous().t()  # non-contiguous

    def forward(self, x):
        return self.lin(self.bn(self.conv(x)).flatten(1))


def _odd_batch(rank, step):
    return torch.randn(4, 2, 2, 2, generator=torch.Generator().manual_seed(10 * step + rank), dtype=torch.float64)


def _train_odd(me, stage_name):
    model = Odd()
    model.bn.num_batches_tracked.fill_(100 + me.rank)  # rank 0's must win the wrap-time broadcast
    stage = make_stage(stage_name, model, torch.optim.SGD(model.parameters(), lr=0.1), make_comm("ring", check=True))
    for step in range(2):
        stage.zero_grad()
        stage(_odd_batch(me.rank, step)).pow(2).mean().backward()
        stage.step()
    state = stage.full_state_dict() if hasattr(stage, "full_state_dict") else model.state_dict()
    return {k: v.clone() for k, v in state.items()}


@pytest.mark.parametrize("stage", STAGES)
def test_channels_last_non_contiguous_and_integer_buffers_train_like_one_device(pools, stage):
    reference = Odd()
    reference.bn.num_batches_tracked.fill_(100)
    optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)
    for step in range(2):
        optimizer.zero_grad()
        (reference(_odd_batch(0, step)).pow(2).mean() + reference(_odd_batch(1, step)).pow(2).mean()).div(2).backward()
        optimizer.step()
    for state in pools.run(2, _train_odd, stage):
        for name, want in reference.state_dict().items():
            assert torch.allclose(state[name], want, rtol=0, atol=1e-12), name


def _wrap(me, what, stage_name="ddp"):
    torch.manual_seed(0)
    if what == "meta":
        with torch.device("meta"):
            model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    elif what == "sparse":
        model = nn.Sequential(nn.Embedding(10, 4, sparse=True), nn.Linear(4, 2))
    else:
        model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    params = list(model.parameters()) + ([nn.Parameter(torch.ones(3))] if what == "foreign" else [])
    make_stage(stage_name, model, torch.optim.SGD(params, lr=0.1), make_comm("ring", check=True),
                       **({"prefetch": -1} if what == "prefetch" else {}))
    if what == "twice":  # a second stage over the same model would run the first one's hooks too
        make_stage(stage_name, model, torch.optim.SGD(params, lr=0.1), make_comm("ring", check=True))
    if what == "direct":
        with torch.no_grad():
            model(torch.ones(2, 4))  # evaluation through the model itself: fine
        model(torch.ones(2, 4))  # with autograd: its gradients would never be synchronised


@pytest.mark.parametrize("what, stage, message", [
    ("meta", "zero1", "'0.weight' is on the meta device (a shape without storage), so there is nothing to broadcast "
                      "or shard. Materialise the model first"),
    ("sparse", "ddp", "module '0' produces sparse gradients (sparse=True); minizero's buffers hold dense gradients. "
                      "Construct it with sparse=False."),
    ("foreign", "zero2", "the optimizer holds 1 tensor(s) that are not parameters of the model (param group, shape: [(0, (3,))])"),
    ("prefetch", "zero3", "prefetch must be a whole number of units >= 0, got -1"),
    ("twice", "ddp", "this model is already wrapped by a ddp stage; a model belongs to one stage"),
    ("direct", "ddp-bucketed", "the wrapped model was called directly with autograd on. Call the stage -- stage(x), "
                               "not model(x) -- so that its backward synchronises gradients; for evaluation, "
                               "wrap the call in torch.no_grad()"),
])
def test_what_no_stage_can_work_with_is_refused_at_wrap_time(pools, what, stage, message):
    with pytest.raises(RankError) as info:
        pools.run(2, _wrap, what, stage)
    assert message in str(info.value)


@pytest.mark.parametrize("bad", [0, -1.0, float("nan")])
def test_a_pool_needs_a_positive_timeout(bad):
    from minizero.run.launch import RankPool
    with pytest.raises(ValueError, match="timeout_s must be > 0 seconds"):
        RankPool(2, timeout_s=bad)

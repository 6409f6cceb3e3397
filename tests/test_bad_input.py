"""Bad input gets a clear error that names the rank, the thing and the fix."""
from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from torch import nn

from minizero.comm import make_comm
from minizero.launch import RankError
from minizero.stages import make_stage
from minizero.train import shard_step


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


def _cli(*args):
    return subprocess.run([sys.executable, "-m", "minizero", *args], capture_output=True, text=True, timeout=120)


def test_unknown_stage_lists_the_valid_ones():
    out = _cli("compare", "--stages", "ddp,zero9")
    assert out.returncode == 2
    assert "unknown stage(s) ['zero9']; valid stages: ddp" in out.stderr


def test_world_size_below_one_on_the_command_line():
    out = _cli("compare", "--world-size", "0")
    assert out.returncode == 2 and "world_size must be an integer >= 1, got 0" in out.stderr


def test_stage_without_comm_is_refused():
    model = nn.Linear(2, 2)
    with pytest.raises(ValueError, match="pass a Comm"):
        make_stage("ddp", model, torch.optim.SGD(model.parameters(), lr=0.1))

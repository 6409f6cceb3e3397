"""Lessons 7 and 10 draw the layout of model states from the package: the drawings must say what the package does.

* Lesson 10 (where the masters live): each stage's kinds of state, whole or sharded, add up to its own formula.
* Lesson 7 (the flat layout): the pieces the ranks own cover every parameter exactly once, shards are equal,
  the padding is less than N, and a parameter cut between ranks is reported as straddling.
"""
from __future__ import annotations

import pytest
import torch

from minizero.course.figures import flat_layout, masters
from minizero.course.harness.optimizers import make_optimizer
from minizero.course.harness.tasks import TASKS
from minizero.stages import STAGES


@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("stage", ["ddp", "zero1", "zero2", "zero3"])
def test_the_kinds_add_up_to_the_stage_formula(stage, precision):
    for n in (1, 3, 4):
        assert masters.bytes_per_parameter(stage, n, precision) == pytest.approx(
            STAGES[stage].state_bytes(1, n, masters.MASTER_BYTES, masters.ADAM_STATES, precision))
    assert ("fp32 master" in [k for k, _, _ in masters.kinds(stage, precision)]) == (precision != "fp32")


def test_zero1_in_mixed_precision_shards_12_bytes_and_saves_9_at_n_4():
    assert sum(b for _, b, sharded in masters.kinds("zero1", "bf16") if sharded) == 12
    assert 16 - masters.bytes_per_parameter("zero1", 4, "bf16") == 9


@pytest.mark.parametrize("world_size", [1, 3, 4])
def test_the_pieces_cover_every_parameter_once(world_size):
    model = TASKS["gpt"].make_model(0, torch.float32)
    optimizer = make_optimizer("adamw", model, 1e-3, param_groups=True)
    groups = flat_layout.layout(model, optimizer, world_size)
    shapes = dict(model.named_parameters())
    for g in range(len(groups[0])):
        group = groups[0][g]
        assert 0 <= group.padding < world_size and (group.numel + group.padding) % world_size == 0
        for name, pieces in flat_layout.owners(groups, g).items():
            covered = sorted((start, stop) for _, start, stop in pieces)
            assert covered[0][0] == 0 and covered[-1][1] == shapes[name].numel()
            assert all(a[1] == b[0] for a, b in zip(covered, covered[1:], strict=False))
    cut = flat_layout.straddlers(groups)
    assert all(len(pieces) > 1 for _, _, pieces in cut)
    assert bool(cut) == (world_size > 1)  # the lesson's model has parameters cut between ranks
    assert [p for _, p in model.named_parameters()][0].data_ptr() != groups[0][0].data.data_ptr()  # a copy drawn

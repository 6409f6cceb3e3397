"""Code written for FSDP2 runs on minizero: the idioms an FSDP2 user brings, each proven against one device.

* the optimizer built *after* wrapping under mixed precision (FSDP2's ``MixedPrecisionPolicy``): it steps
  fp32 parameters -- the masters -- and the model computes in 16 bits;
* every parameter's gradient in its full shape on request (FSDP2's ``param.grad.full_tensor()``), not only
  the 1-D pieces a ZeRO rank holds;
* modules left replicated inside a ZeRO-3 model (all-reduced, not sharded), as FSDP2 leaves the modules it
  does not wrap.
"""
from __future__ import annotations

import pytest
import torch
from torch import nn

from minizero.comm import make_comm
from minizero.stages import make_stage

WORLD = 3
CORE = ["ddp", "ddp-bucketed", "zero1", "zero2", "zero3", "ps"]


class Blocks(nn.Module):
    """Three blocks (ZeRO-3 units: the ModuleList's elements) and a head used only when asked."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.ModuleList([nn.Linear(4, 7), nn.Linear(7, 5), nn.Linear(5, 5)]).double()
        self.head, self.spare = nn.Linear(5, 2).double(), nn.Linear(5, 2).double()

    def forward(self, x, spare=False):
        for block in self.blocks:
            x = torch.tanh(block(x))
        return self.head(x) + (self.spare(x) if spare else 0)


def _batch(rank: int) -> torch.Tensor:
    return torch.randn(5 + rank, 4, generator=torch.Generator().manual_seed(7 + rank), dtype=torch.float64)


def _loss(output: torch.Tensor, total: int) -> torch.Tensor:
    """The global batch's mean, from this rank's part of it (ranks hold different numbers of samples)."""
    return output.pow(2).sum() / total


TOTAL = sum(5 + r for r in range(WORLD))


def _single_device_gradients() -> dict[str, torch.Tensor | None]:
    model = Blocks()
    x = torch.cat([_batch(r) for r in range(WORLD)])
    _loss(model(x), TOTAL).backward()
    return {n: p.grad for n, p in model.named_parameters()}


def _full_gradients(me, stage_name):
    model = Blocks()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    stage = make_stage(stage_name, model, optimizer, make_comm("ring", check=True), find_unused_parameters=True)
    (_loss(stage(_batch(me.rank)), TOTAL) * WORLD).backward()
    return stage.full_gradients()


@pytest.mark.parametrize("stage", CORE)
def test_every_gradient_in_its_full_shape_is_the_single_device_gradient(pools, stage):
    want = _single_device_gradients()
    for got in pools.run(WORLD, _full_gradients, stage):
        assert got.keys() == want.keys()
        for name, grad in want.items():
            if grad is None:  # `spare` is used nowhere: no rank holds a gradient for it
                assert got[name] is None, name
            else:
                assert got[name].shape == grad.shape, name
                assert torch.allclose(got[name], grad, rtol=1e-12, atol=1e-15), (name, (got[name] - grad).abs().max())

"""Clipping on both sides of the norm, and resume bit for bit with dropout, on every stage.

Clipping: the coefficient max_norm / (norm + eps) is capped at 1, so a gradient whose norm is below
max_norm is left as it is.  A test that only ever clips cannot tell that from a clip that always scales;
so each stage clips, at N = 3 (uneven shards), with the max_norms the property suite draws
(``minizero.course.harness.drawn``: one below every norm, one far above), in the L2 and the inf norm, and must give
torch's ``clip_grad_norm_`` on one device -- the norm it returns and the step it leads to.

Resume: a model with dropout, fed in an order drawn from torch's global generator (as a shuffling
``DataLoader`` draws it), trains S steps, saves (sharded), and a fresh stage in the same layout -- its
generator seeded elsewhere on purpose -- loads and trains on: bit for bit the uninterrupted run, on every
stage that can be checkpointed.  Each rank draws its own masks and order, so each rank's generator must
come back as it was.
"""
from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch
from hypothesis import given, settings
from torch import nn

from minizero import checkpoint
from minizero.comm import make_comm
from minizero.course.harness import drawn
from minizero.course.harness.experiment import reference_of
from minizero.course.harness.tasks import TASKS
from minizero.run.train import Step, shard_step, sum_loss, train_step
from minizero.stages import STAGES, Stage, distributed, make_stage
from tests.equivalence import examples, experiments, run_and_check
from tests.test_checkpoint import assert_same_optimizer_state
from tests.test_wrapped_optimizer_state import OPTIONS, SAMPLES, SIZES  # the same stages, options and model

# Every stage that clips the global norm (local SGD clips each rank's own gradient, by design).
CLIPPED = [name for name in distributed() if name != "local-sgd"]


def _batch(step: int = 0):
    return TASKS["mlp"].make_batch(SAMPLES, 11, step, torch.float64, sizes=SIZES)


def _model():
    return TASKS["mlp"].make_model(5, torch.float64, sizes=SIZES)


def torch_clip(max_norm: float, norm_type: float):
    """One device, plain torch: the norm ``clip_grad_norm_`` returns and the parameters after SGD(lr=1)."""
    model = _model()
    x, y = _batch()
    (sum_loss(model(x), y) / y.numel()).backward()
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm, norm_type)
    torch.optim.SGD(model.parameters(), lr=1.0).step()
    return norm.item(), {n: p.detach().clone() for n, p in model.named_parameters()}


def _clip_on_rank(me, stage: str, max_norm: float, norm_type: float):
    model = _model()
    wrapped = make_stage(stage, model, torch.optim.SGD(model.parameters(), lr=1.0), make_comm("ring", check=True),
                         **OPTIONS.get(stage, {}))
    step = shard_step(*_batch(), me.rank, me.world_size)
    wrapped.zero_grad()
    (sum_loss(wrapped(*step.micro_batches[0][:1]), step.micro_batches[0][1])
     * me.world_size / step.global_count).backward()
    norm = wrapped.clip_grad_norm_(max_norm, norm_type)
    wrapped.step()
    state = wrapped.full_state_dict()
    return float(norm), {n: state[n] for n, _ in model.named_parameters()}


@pytest.mark.parametrize("side, clip", [("clips", c) for c in drawn.CLIPPING] + [("never clips", c) for c in
                                                                                   drawn.NOT_CLIPPING], ids=str)
@pytest.mark.parametrize("stage", CLIPPED)
def test_clipping_is_torch_s_on_both_sides_of_the_norm(pools, stage, side, clip):
    max_norm, norm_type = clip
    want_norm, want = torch_clip(max_norm, norm_type)
    assert (want_norm > max_norm) == (side == "clips"), f"max_norm {max_norm} is not on the side it is drawn for"
    for rank, (norm, params) in enumerate(pools.run(3, _clip_on_rank, stage, max_norm, norm_type)):
        assert abs(norm - want_norm) <= 1e-12 * want_norm, f"{stage}, rank {rank}: norm {norm} != torch's {want_norm}"
        for name, value in want.items():
            err = (params[name] - value).abs().max().item()
            assert err <= 1e-12, f"{stage}, rank {rank}, {side}: {name} is {err:.3g} from torch's clipped step"


def test_the_drawn_max_norms_lie_on_their_side_of_every_drawn_gradient():
    """The suite's clipping draws mean what they say only if every gradient norm its drawn models reach lies
    between the two sides: checked on the reference (one process, no ranks), at every clipped step."""
    seen: list[tuple[float, float]] = []
    original = Stage.clip_grad_norm_

    def recording(self, max_norm, norm_type=2.0):
        norm = original(self, max_norm, norm_type)
        seen.append((max_norm, float(norm)))
        return norm

    @settings(max_examples=examples(30), derandomize=True, database=None)
    @given(pair=drawn.experiments(precision=True).filter(lambda pair: pair[0].clip is not None))
    def each(pair):
        exp, world_size = pair
        seen.clear()
        reference_of(exp, world_size)
        assert seen, f"the reference never clipped ({exp})"
        side = drawn.clip_side(exp.clip)
        for max_norm, norm in seen:  # (fp16's overflowed steps have no norm: they are skipped, not clipped)
            assert not math.isfinite(norm) or (norm > max_norm) == (side == "clips"), \
                f"norm {norm:.3g} against max_norm {max_norm:g} ({exp})"

    Stage.clip_grad_norm_ = recording
    try:
        each()
    finally:
        Stage.clip_grad_norm_ = original


@pytest.mark.parametrize("stage", CLIPPED)
def test_every_stage_s_clipping_property_draws_both_sides_of_the_norm(pools, stage):
    """The equivalence property, drawn where it clips, on each stage: its draws clip on both sides of the norm
    (``drawn.missing_clip_sides``), so a clip that always scales -- a mutant -- is caught by it.  (ps-async
    without staleness: the one draw of it that is single-device training.)"""
    seen = []

    @settings(max_examples=examples(8), derandomize=True, database=None)
    @given(pair=experiments(stage, world_sizes=(2, 3)).filter(lambda pair: pair[0].clip is not None))
    def clipped(pair):
        exp, world_size = pair
        seen.append(exp)
        if stage == "ps-async":
            exp = replace(exp, options={**exp.options, "staleness": 0})
        run_and_check(pools, exp, world_size)

    clipped()
    assert not drawn.missing_clip_sides(seen), f"{stage}: the draws never had {drawn.missing_clip_sides(seen)}"


# ------------------------------------------------------------------------------- resume with dropout
CHECKPOINTABLE = [name for name in distributed() if STAGES[name].why_not_checkpointable is None]
POOL = 24  # samples a rank draws its batches from


class DropoutMLP(nn.Module):
    """Two layers with dropout between: every forward in training mode draws a mask from torch's generator."""

    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(4, 7), nn.Tanh(), nn.Dropout(0.3), nn.Linear(7, 3))
        generator = torch.Generator().manual_seed(0)
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=generator, dtype=p.dtype) / 2)

    def forward(self, x):
        return self.net(x)


def _train_with_dropout(me, stage: str, steps: range, save=None, resume=None, consolidated=False):
    """Steps ``steps`` of training with dropout; each rank shuffles its own data with torch's global generator
    (seeded per rank).  A resumed run seeds it elsewhere first: the checkpoint must put the rank's back."""
    torch.manual_seed(1000 + me.rank if resume is None else 7)
    data = torch.Generator().manual_seed(me.rank)
    xs, ys = torch.randn(POOL, 4, generator=data), torch.randn(POOL, 3, generator=data)
    model = DropoutMLP()
    wrapped = make_stage(stage, model, torch.optim.AdamW(model.parameters(), lr=0.05),
                         make_comm("ring", check=True), **OPTIONS.get(stage, {}))
    if resume is not None:
        checkpoint.load(wrapped, resume)
    losses, params = [], []
    for _ in steps:
        order = torch.randperm(POOL)[:2]  # a shuffling DataLoader's draw
        losses.append(train_step(wrapped, Step([(xs[order], ys[order])], global_count=2 * 3 * me.world_size)))
        state = wrapped.full_state_dict()
        params.append({n: state[n] for n, _ in model.named_parameters()})
    if save is not None:
        checkpoint.save(wrapped, save, steps.stop, consolidated=consolidated)
    return losses, params, wrapped.full_optimizer_state_dict()


def assert_resumed_bit_exact(pools, directory, stage: str, consolidated: bool = False) -> None:
    """Four steps straight, against two, a save, and two more in a fresh stage at the same N."""
    whole = pools.run(3, _train_with_dropout, stage, range(0, 4))
    pools.run(3, _train_with_dropout, stage, range(0, 2), save=str(directory), consolidated=consolidated)
    resumed = pools.run(3, _train_with_dropout, stage, range(2, 4), resume=str(directory))
    for rank, (a, b) in enumerate(zip(whole, resumed, strict=True)):
        assert b[0] == a[0][2:], f"{stage}, rank {rank}: losses after the resume {b[0]} != {a[0][2:]}"
        for i, params in enumerate(b[1]):
            for name, value in params.items():
                assert torch.equal(value, a[1][2 + i][name]), f"{stage}, rank {rank}, step {2 + i}: {name}"
        assert_same_optimizer_state(b[2], a[2], f"{stage}, rank {rank}")


@pytest.mark.parametrize("stage", CHECKPOINTABLE)
def test_resume_with_dropout_is_bit_exact(pools, tmp_path, stage):
    assert_resumed_bit_exact(pools, tmp_path, stage)


@pytest.mark.parametrize("stage", ["ddp", "zero2"])
def test_resume_with_dropout_from_a_consolidated_checkpoint_is_bit_exact(pools, tmp_path, stage):
    assert_resumed_bit_exact(pools, tmp_path, stage, consolidated=True)

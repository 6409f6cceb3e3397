"""Activation checkpointing (:mod:`minizero.parts.activations`) composed with every stage: the ranks replay each block's
forward inside backward, the reference never does -- and training is the same, bit for bit where the suite's
equivalence is.  ZeRO-3 gathers a replayed unit once (its bytes and gathered peak are those of the step without
checkpointing, units nested inside a block included); the bucketed stages launch each bucket once."""
from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from hypothesis import given, settings

from minizero.course.harness.experiment import Experiment, run_experiment
from minizero.course.harness.models import MLP, TinyGPT
from minizero.parts.activations import checkpoint_blocks, checkpointed_blocks
from minizero.stages import STAGES, distributed
from tests.equivalence import examples, experiments, run_and_check


def checkpointed(drawn):
    exp, world_size = drawn
    return replace(exp, checkpoint_activations=True), world_size


@pytest.mark.parametrize("stage", distributed())
def test_every_stage_with_checkpointed_blocks_trains_as_without(pools, stage):
    """A stage equivalent to single-device training stays so; the others (stale pulls, local SGD) train exactly
    as they do without checkpointing."""
    @settings(max_examples=examples(4))
    @given(drawn=experiments(stage, max_accum=2).map(checkpointed))
    def prop(drawn):
        if STAGES[stage].equivalent:
            run_and_check(pools, *drawn)
            return
        exp, n = drawn
        replayed, plain = (pools.run(n, run_experiment, e) for e in (exp, replace(exp, checkpoint_activations=False)))
        for rank, (a, b) in enumerate(zip(plain, replayed, strict=True)):
            assert a.losses == b.losses, (rank, a.losses, b.losses)
            for step, (pa, pb) in enumerate(zip(a.params, b.params, strict=True)):
                for name, value in pa.items():
                    assert torch.equal(pb[name], value), (rank, step, name)
    prop()


#: The replay's bookkeeping, where it can go wrong: ZeRO-3 and HSDP with their blocks as units (no unit hook fires
#: in the replay) and with units *inside* the blocks (their hooks fire again, inside backward); the bucketed stages.
CASES = [("zero3", {}), ("zero3", {"units": ["blocks.0.attn", "blocks.1.fc"]}), ("zero3", {"prefetch": 2}),
         ("hsdp", {"units": ["blocks.0.attn", "blocks.1.fc"]}), ("ddp-bucketed", {"bucket_mb": 0.01}),
         ("zero2", {"bucket_mb": 0.01})]


@pytest.mark.parametrize("stage, options", CASES, ids=[f"{s}-{'-'.join(o) or 'default'}" for s, o in CASES])
def test_a_checkpointed_step_sends_and_gathers_what_it_does_without(pools, stage, options):
    """Replayed forwards are not new forwards: the same collectives, bytes and gathered peak as without
    checkpointing, and the same parameters to the bit (a unit gathered twice would send 1/3 more for ZeRO-3)."""
    exp = Experiment(stage=stage, task="gpt", steps=2, accum=2, dtype="float64", optimizer="adam", options=options)
    plain = pools.run(4, run_experiment, exp)
    replayed = pools.run(4, run_experiment, replace(exp, checkpoint_activations=True))
    for rank, (a, b) in enumerate(zip(plain, replayed, strict=True)):
        assert b.sent_by_kind == a.sent_by_kind and b.sent_per_step == a.sent_per_step, (rank, a.sent_by_kind,
                                                                                           b.sent_by_kind)
        assert b.gathered_peak_bytes == a.gathered_peak_bytes, (rank, a.gathered_peak_bytes, b.gathered_peak_bytes)
        for name, value in a.params[-1].items():
            assert torch.equal(b.params[-1][name], value), (rank, name)


def test_a_checkpointed_block_runs_its_forward_again_in_backward_and_keeps_its_names():
    """Not a no-op: each block's insides compute twice per step (forward, then the replay); the module tree, the
    parameter names and the gradients are the plain model's."""
    plain, model = TinyGPT(n_layer=2, seed=3, dtype=torch.float64), TinyGPT(n_layer=2, seed=3, dtype=torch.float64)
    assert checkpoint_blocks(model) == ["blocks.0", "blocks.1"] == checkpointed_blocks(model)
    assert [n for n, _ in model.named_parameters()] == [n for n, _ in plain.named_parameters()]
    calls = []
    model.blocks[1].fc.register_forward_hook(lambda *_: calls.append(torch._C._current_graph_task_id() != -1))
    idx = torch.randint(0, 48, (3, 16), generator=torch.Generator().manual_seed(0))
    for m in (plain, model):
        m(idx).square().mean().backward()
    assert calls == [False, True]  # once in forward, once replayed inside backward
    for (name, a), b in zip(plain.named_parameters(), model.parameters(), strict=True):
        assert torch.equal(a.grad, b.grad), name
    with torch.no_grad():
        model(idx)
    assert calls == [False, True, False]  # evaluation: nothing saved, nothing replayed


class _DropoutBlocks(torch.nn.Module):
    """Blocks of Linear, dropout and tanh: a replay that drew another mask than the forward would change every
    gradient before it."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(5)
        self.blocks = torch.nn.ModuleList(torch.nn.Sequential(torch.nn.Linear(6, 6, dtype=torch.float64),
                                                              torch.nn.Dropout(0.5), torch.nn.Tanh())
                                          for _ in range(3))

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return x


def test_a_replayed_block_draws_the_same_dropout_mask_as_its_forward():
    """The replay inside backward restores the random state the forward began with (torch's preserve_rng_state):
    a model with dropout in every block gets, checkpointed, the plain model's gradients bit for bit, and they are not
    those of another draw -- so the masks are the forward's, not merely some masks."""
    x = torch.randn(4, 6, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    grads = []
    for checkpointed_now, seed in ((False, 7), (True, 7), (False, 8)):
        model = _DropoutBlocks()
        if checkpointed_now:
            checkpoint_blocks(model)
        torch.manual_seed(seed)
        model(x).square().sum().backward()
        grads.append([p.grad.clone() for p in model.parameters()])
    plain, replayed, other_draw = grads
    assert all(torch.equal(a, b) for a, b in zip(plain, replayed, strict=True))
    assert not all(torch.equal(a, b) for a, b in zip(plain, other_draw, strict=True))  # the masks matter


def test_checkpointing_the_whole_model_or_a_block_twice_is_refused():
    model = MLP((3, 4, 2))
    with pytest.raises(ValueError, match="the whole model is not a block"):
        checkpoint_blocks(model, [model])
    checkpoint_blocks(model, ["layers.0"])
    with pytest.raises(ValueError, match="'layers.0' is checkpointed already"):
        checkpoint_blocks(model, ["layers.0"])

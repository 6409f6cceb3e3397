"""An optimizer that already has state keeps it when any stage wraps it (minizero.parts.kept_state).

Every rank takes the same two steps of single-device training unwrapped (AdamW's moments and step
count, or SGD's momentum buffer, now exist), then wraps model and optimizer and trains two more steps
on the same global batches.  That must be single-device training going on: the consolidated state right
after wrapping is the unwrapped optimizer's, bit for bit -- sharded for ZeRO and the parameter servers,
whole for ddp and local SGD -- and two more steps land where the unwrapped optimizer lands (float64, the
suite's tolerance).  Under mixed precision the stage is compared, bit for bit, with the same stage
wrapped over a fresh optimizer that then loads the state: the resume path the checkpoint tests prove.
"""
from __future__ import annotations

import copy

import pytest
import torch

from minizero.comm import make_comm
from minizero.course.harness.optimizers import make_optimizer
from minizero.course.harness.tasks import TASKS
from minizero.parts.precision import Precision
from minizero.run.train import shard_step, train_step
from minizero.stages import STAGES, distributed, make_stage
from tests.test_checkpoint import assert_same_optimizer_state

SIZES = (4, 7, 3)  # 59 elements: uneven shards at N = 2 and 3, parameters straddling ranks
#: The tasks' models: the MLP above; a GPT whose embedding is tied to its head (one parameter, one state).
MODELS = {"mlp": {"sizes": SIZES}, "gpt": {"d_model": 8, "n_layer": 1, "n_head": 2, "block_size": 4}}
SAMPLES = 6  # per global batch: splits over 1, 2 and 3 ranks
RTOL = 1e-9  # the suite's float64 tolerance (minizero.course.harness.equivalence)

#: Options that make each stage take single-device training's step: a parameter server with a pure worker
#: at N = 3, the asynchronous one with no staleness (ps, bit for bit), local SGD averaging every step.
OPTIONS = {"zero2": {"bucket_mb": 1e-9}, "ps": {"servers": 2}, "ps-async": {"servers": 2, "staleness": 0},
           "local-sgd": {"average_every": 1}, "ddp-bucketed": {"bucket_mb": 1e-9}}


def options_for(stage: str, world_size: int) -> dict:
    options = dict(OPTIONS.get(stage, {}))
    if "servers" in options:
        options["servers"] = min(options["servers"], world_size)
    return options


def _batch(step: int, dtype: torch.dtype, task: str = "mlp"):
    return TASKS[task].make_batch(SAMPLES, 7, step, dtype, **MODELS[task])


def warmed(optimizer_name: str, dtype: torch.dtype = torch.float64, task: str = "mlp"):
    """A model and its optimizer after two steps of single-device training: what every rank wraps."""
    model = TASKS[task].make_model(3, dtype, **MODELS[task])
    optimizer = make_optimizer(optimizer_name, model, 0.05, param_groups=True)
    for group in optimizer.param_groups:  # hyper-parameters of the user's own, kept as they are
        group.update({"betas": (0.8, 0.95)} if "betas" in group else {"dampening": 0.1})
    reference = make_stage("reference", model, optimizer)
    for s in range(2):
        train_step(reference, shard_step(*_batch(s, dtype, task), 0, 1))
    return model, optimizer


def continue_unwrapped(optimizer_name: str, task: str = "mlp"):
    """The truth: the parameters and global losses after two more steps with the unwrapped optimizer, on one
    device (here, in the test's process)."""
    model, optimizer = warmed(optimizer_name, task=task)
    reference = make_stage("reference", model, optimizer)
    losses = [train_step(reference, shard_step(*_batch(s, torch.float64, task), 0, 1)) for s in (2, 3)]
    return {n: p.detach().clone() for n, p in model.named_parameters()}, losses


def _wrap_and_continue(me, stage: str, optimizer_name: str, options: dict, dtype=torch.float64, via_load=False,
                       task="mlp"):
    """On every rank: the warmed model and optimizer wrapped by ``stage``; two more steps on this rank's share of the batch.
    ``via_load``: wrap a fresh optimizer instead and load the warmed one's state_dict through the stage."""
    model, optimizer = warmed(optimizer_name, dtype, task)
    given = copy.deepcopy(optimizer.state_dict())  # this rank's (its threads may round the warm-up otherwise)
    if via_load:
        saved = copy.deepcopy(optimizer.state_dict())
        optimizer = make_optimizer(optimizer_name, model, 0.05, param_groups=True)
    stage_ = make_stage(stage, model, optimizer, make_comm("ring", check=True), **options)
    if via_load:
        stage_.load_full_optimizer_state_dict(saved)
    at_wrap = copy.deepcopy(stage_.full_optimizer_state_dict())  # ddp's is the live state
    losses = [train_step(stage_, shard_step(*_batch(s, dtype, task), me.rank, me.world_size)) for s in (2, 3)]
    state = stage_.full_state_dict()
    return at_wrap, {n: state[n] for n, _ in model.named_parameters()}, losses, stage_.full_optimizer_state_dict(), given


def _worst(params: dict, want: dict) -> float:
    scale = max(p.abs().max().item() for p in want.values())
    return max((params[n] - want[n]).abs().max().item() for n in want) / scale


def _cases():
    for stage in distributed():
        for world_size in (1, 2, 3):  # Adam's moments and step at every N; SGD's momentum buffer at N = 3
            yield stage, "momentum" if stage == "local-sgd" else "adamw", world_size, "mlp"
        if stage != "local-sgd":
            yield stage, "momentum", 3, "mlp"
        yield stage, "momentum" if stage == "local-sgd" else "adamw", 3, "gpt"


@pytest.mark.parametrize("stage, optimizer_name, world_size, task", list(_cases()))
def test_state_given_at_wrap_is_kept_and_training_goes_on(pools, stage, optimizer_name, world_size, task):
    """(local SGD averages every step with momentum SGD: averaging is linear, so that is single-device
    training; with Adam's per-rank second moments it is not.)"""
    want, want_losses = continue_unwrapped(optimizer_name, task)
    results = pools.run(world_size, _wrap_and_continue, stage, optimizer_name, options_for(stage, world_size),
                        task=task)
    for rank, (at_wrap, params, _, _, before) in enumerate(results):
        assert before["state"], "the warm-up left no state to keep"
        assert_same_optimizer_state(at_wrap, before, f"{stage}, N={world_size}, rank {rank}, right after wrapping")
        worst = _worst(params, want)
        assert worst <= RTOL, f"{stage}, N={world_size}, rank {rank}: two more steps land {worst:.3g} away"
    for step, want_loss in enumerate(want_losses):
        total = sum(r[2][step] for r in results)
        assert abs(total - want_loss) <= RTOL * abs(want_loss), f"{stage}: loss of step {step + 2}"


MIXED = [name for name in distributed() if "precision" in STAGES[name].option_names()]


@pytest.mark.parametrize("precision", [Precision("bf16"), Precision("fp16", loss_scale=2.0 ** 4)], ids=lambda p: p.name)
@pytest.mark.parametrize("stage", MIXED)
def test_mixed_precision_keeps_the_state_in_its_masters(pools, stage, precision):
    """The masters' optimizer starts from the state given: bit for bit what loading it through the stage gives."""
    options = {**options_for(stage, 3), "precision": precision}
    given = pools.run(3, _wrap_and_continue, stage, "adamw", options, torch.float32)
    loaded = pools.run(3, _wrap_and_continue, stage, "adamw", options, torch.float32, True)
    for rank, (a, b) in enumerate(zip(given, loaded, strict=True)):
        assert a[0]["state"], f"{stage}: no state right after wrapping"
        assert_same_optimizer_state(a[0], b[0], f"{stage} {precision.name}, rank {rank}, right after wrapping")
        for name in b[1]:
            assert torch.equal(a[1][name], b[1][name]), f"{stage} {precision.name}, rank {rank}: {name}"
        assert a[2] == b[2], f"{stage} {precision.name}, rank {rank}: losses"
        assert_same_optimizer_state(a[3], b[3], f"{stage} {precision.name}, rank {rank}, after two steps")


# ------------------------------------------------------------------------------- what cannot be kept
def _wrap_mismatched(me, stage: str, options: dict):
    """A state_dict of another model with as many parameters, loaded by index (torch checks only the counts):
    its moments are shaped for that model.  The wrap is refused; nothing changed, the model wraps later."""
    other = TASKS["mlp"].make_model(3, torch.float64, sizes=(4, 5, 3))
    donor = torch.optim.AdamW(other.parameters(), lr=0.05)
    other(torch.ones(2, 4, dtype=torch.float64)).sum().backward()
    donor.step()
    model = TASKS["mlp"].make_model(3, torch.float64, sizes=SIZES)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.05)
    optimizer.load_state_dict(donor.state_dict())
    try:
        make_stage(stage, model, optimizer, make_comm("ring", check=True), **options)
    except ValueError as error:
        untouched = getattr(model, "_minizero_stage", None) is None and \
            optimizer.state[model.layers[0].weight]["exp_avg"].shape == (5, 4)
        return str(error), untouched
    return None, False


@pytest.mark.parametrize("stage", distributed())
def test_state_that_cannot_be_kept_is_refused_at_wrap_naming_parameter_and_key(pools, stage):
    for rank, (message, untouched) in enumerate(pools.run(2, _wrap_mismatched, stage, options_for(stage, 2))):
        assert message is not None, f"{stage}: a state shaped for another model was wrapped"
        assert message.startswith(f"rank {rank}: the optimizer's state 'exp_avg' of parameter 'layers.0.weight' "
                                  f"has shape (5, 4), but the parameter has shape (7, 4)"), message
        assert untouched, f"{stage}: the refused wrap changed the model or the optimizer"

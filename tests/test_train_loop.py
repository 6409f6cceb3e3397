"""The one training loop is plain torch training: checked against a loop written out by hand.

Every stage is compared with the reference, and the reference runs through the
same ``train_step`` -- so a bug in the loop (no zero_grad, clipping after the
step) would hide in both.  Here the reference meets torch with nothing shared.
"""
from __future__ import annotations

import torch

from minizero.course.harness import experiment
from minizero.course.harness.optimizers import make_optimizer
from minizero.course.harness.tasks import TASKS
from minizero.run.train import sum_loss


def test_the_reference_is_plain_torch_training():
    exp = experiment.Experiment(stage="reference", task="mlp", optimizer="adamw", lr=0.05, steps=3, accum=2,
                                dtype="float64", clip=(0.05, 2.0))
    ours = experiment.run_experiment(None, exp, world_size=2)
    task = TASKS["mlp"]
    model = task.make_model(exp.seed, torch.float64)
    optimizer = make_optimizer("adamw", model, exp.lr)
    for step in range(exp.steps):
        x, y = task.make_batch(exp.global_batch(2), exp.seed, step, torch.float64)
        optimizer.zero_grad()
        (sum_loss(model(x), y) / y.numel()).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), *exp.clip)
        optimizer.step()
        for name, p in model.named_parameters():
            assert torch.allclose(ours.params[step][name], p, rtol=0, atol=1e-13), (step, name)

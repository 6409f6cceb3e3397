"""The hooks a stage leaves on the model at wrap time, run in every step: a parameter's post-accumulate-grad hook
calling the stage's ``post_accumulate_grad`` (held weakly, so the stage can be freed), and a forward pre-hook on
the model refusing a call that does not come through the stage.
"""
from __future__ import annotations

import weakref

import torch
from torch import nn


def when_accumulated(param: nn.Parameter, stage) -> None:
    """Call ``stage.post_accumulate_grad(param)`` each time ``param.grad`` is complete, holding the stage weakly.

    torch keeps a parameter's post-accumulate-grad hooks in C++, out of the garbage collector's sight: a hook
    bound to the stage would close the cycle stage -> model -> parameter -> hook -> stage, which nothing frees,
    so every stage a process built would stay alive with its buffers (measured: about 300 MB more per ZeRO-1 run
    of the medium GPT in one pool of ranks, until ``bench all --model large`` was killed for memory)."""
    alive = weakref.ref(stage)

    def hook(p: nn.Parameter) -> None:
        owner = alive()
        if owner is None:
            raise RuntimeError(f"{p.shape} parameter: its stage was garbage-collected while its model still "
                               f"trains -- keep the stage (the wrapped model) alive while you use it")
        owner.post_accumulate_grad(p)

    param.register_post_accumulate_grad_hook(hook)


def refuse_direct_calls(module: nn.Module, stage) -> None:
    """``model(x)`` instead of ``stage(x)`` would compute gradients no one synchronises: the replicas would drift
    apart silently.  So the model, once wrapped, refuses a call with autograd on that does not come through the
    stage (``stage._forwarding``); under ``torch.no_grad()`` -- evaluation -- it is fine."""
    def refuse(model, args) -> None:
        if torch.is_grad_enabled() and not stage._forwarding:
            raise RuntimeError(
                f"rank {stage.rank}: the wrapped model was called directly with autograd on. Call the stage -- "
                f"stage(x), not model(x) -- so that its backward synchronises gradients; for evaluation, "
                f"wrap the call in torch.no_grad().")

    module.register_forward_pre_hook(refuse)


def hook_grouped_parameters(stage) -> None:
    """A ZeRO stage's: ``post_accumulate_grad(param)`` each time a grouped parameter's ``.grad`` is complete."""
    for group in stage.groups:
        for s in group.segments:
            when_accumulated(s.param, stage)


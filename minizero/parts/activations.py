"""Activation checkpointing: keep a block's input, not what it computes inside, and compute that again in backward.

Backward needs what forward computed: a transformer block keeps about s*b*h*(34 + 5*a*s/h) bytes of it per layer
(Korthikanti et al. 2022, eq. 1) -- under any ZeRO stage the largest part of a step's memory once the model states
are sharded.  A checkpointed block keeps only its input (s*b*h elements) and runs its forward a second time inside
backward, just before its gradients are needed: most of the activations, for one more forward of compute.

This is torch's own mechanism (``torch.utils.checkpoint``, **non-reentrant**, as FSDP2 and torchtitan apply it per
transformer block): the forward runs once under a hook that saves nothing but the inputs, and backward replays it
when the first saved tensor is asked for.  Non-reentrant keeps the autograd graph whole, so every stage's hooks see
what they see without it: each parameter's gradient is accumulated once, and its post-accumulate-grad hook fires
once (the bucketed stages launch each bucket once).  The replay is the block's *function*, not the module's call:
hooks on the block itself (ZeRO-3's unit hooks, when the block is a unit -- the default) do not fire again; the
unit is gathered for backward before the replay starts, because its pre-backward hook sits on the block's output,
which backward reaches first.  Hooks on modules *inside* a checkpointed block do fire again during the replay
(ZeRO-3 then treats the replay as part of backward: :func:`minizero.parts.units.replayed_by_backward`).

The random state is saved and restored around the replay (``preserve_rng_state``): dropout draws the same mask.
"""
from __future__ import annotations

import functools

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from .unit_plan import default_units


def checkpoint_blocks(model: nn.Module, blocks=None) -> list[str]:
    """Checkpoint each of ``blocks`` (modules, or submodule names; default: every element of every
    ``nn.ModuleList`` -- the transformer blocks, ZeRO-3's default units) and return their names.

    Apply it before wrapping the model in a stage, as FSDP2 wants ``checkpoint_wrapper`` before ``fully_shard``.
    The module objects, their names and their parameters are unchanged (no wrapper module: a checkpoint's keys and a
    stage's units read the same), only the forward each block runs is."""
    chosen = default_units(model) if blocks is None else \
        [model.get_submodule(b) if isinstance(b, str) else b for b in blocks]
    names = {id(m): name for name, m in model.named_modules()}
    for block in chosen:
        if block is model:
            raise ValueError("checkpoint_blocks: the whole model is not a block -- name its submodules (the "
                             "transformer blocks), whose inputs are kept while the rest is recomputed")
        if is_checkpointed(block):
            raise ValueError(f"checkpoint_blocks: {names.get(id(block), type(block).__name__)!r} is checkpointed "
                             f"already; checkpointing it twice would replay its forward twice")
        block.forward = functools.partial(_checkpointed, block.forward)
    return [names.get(id(b), type(b).__name__) for b in chosen]


def is_checkpointed(module: nn.Module) -> bool:
    forward = module.__dict__.get("forward")
    return isinstance(forward, functools.partial) and forward.func is _checkpointed


def checkpointed_blocks(model: nn.Module) -> list[str]:
    """The names of the model's checkpointed blocks."""
    return [name for name, m in model.named_modules() if is_checkpointed(m)]


def _checkpointed(forward, *args, **kwargs):
    if not torch.is_grad_enabled():  # evaluation: nothing is saved, there is nothing to replay
        return forward(*args, **kwargs)
    return checkpoint(forward, *args, use_reentrant=False, **kwargs)

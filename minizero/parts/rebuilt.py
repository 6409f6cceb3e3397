"""The user's optimizer, rebuilt over other tensors: what ZeRO and mixed precision both need.

ZeRO steps this rank's *pieces* of the parameters, mixed precision steps
fp32 *masters* of them; either way the user's optimizer class and
hyper-parameters must step something other than the parameters it was built
over.  :func:`rebuild` makes that optimizer (one group per user group, same
settings) and :func:`follow` carries the user's current settings over before
each step, so a learning-rate scheduler attached to the user's optimizer
drives the rebuilt one.
"""
from __future__ import annotations

import inspect

import torch


def settings(group: dict) -> dict:
    return {k: v for k, v in group.items() if k != "params"}


def rebuild(optimizer_class: type, defaults: dict, param_groups: list[dict],
            params_of_group: list[list[torch.Tensor]]) -> torch.optim.Optimizer:
    """``optimizer_class`` over ``params_of_group[i]`` with ``param_groups[i]``'s settings."""
    # The constructor gets only the defaults it accepts (AdamW's defaults hold keys, like
    # decoupled_weight_decay, that its __init__ does not take); each group carries all its settings.
    accepted = inspect.signature(optimizer_class.__init__).parameters
    return optimizer_class([{**settings(group), "params": params}
                            for group, params in zip(param_groups, params_of_group, strict=True)],
                           **{k: v for k, v in defaults.items() if k in accepted})


def follow(rebuilt: torch.optim.Optimizer, param_groups: list[dict]) -> None:
    """Carry the user's current hyper-parameters (a scheduler's lr, say) over to the rebuilt optimizer."""
    for local_group, group in zip(rebuilt.param_groups, param_groups, strict=True):
        local_group.update(settings(group))

"""An optimizer that already has state, wrapped by a stage, keeps it.

The natural way to resume from a consolidated checkpoint is the plain PyTorch
one -- ``optimizer.load_state_dict(state["optimizer"])`` -- and only then
``make_stage(name, model, optimizer, comm)``.  Every stage that steps something
other than the user's parameters rebuilds the user's optimizer over it (ZeRO
over this rank's *pieces*, mixed precision over fp32 *masters*:
:mod:`minizero.parts.rebuilt`), and a rebuilt optimizer starts empty.  So each of
them takes the state the user's optimizer holds at wrap time:

* per-element state (Adam's ``exp_avg`` and ``exp_avg_sq``, SGD's
  ``momentum_buffer``...) is cut to the range each piece covers -- the same
  :func:`~minizero.parts.part.flat_range` a checkpoint is resharded with -- and cast
  to what is stepped (torch's ``load_state_dict`` casts the same way);
* scalar state (Adam's ``step``) is kept whole, in its own dtype;
* hyper-parameters need no carrying: the stage keeps the user's
  ``param_groups`` and follows them before every step.

Then the user's optimizer lets go of its copy: under ZeRO the whole state left
there would cost every rank the ``K Psi`` bytes sharding saves.  What a
stage cannot carry -- a per-element state shaped unlike its parameter, which
no cutting into ranges makes right -- is refused at wrap time, before anything changes.
"""
from __future__ import annotations

import torch
from torch import nn

from .part import flat_range


def check_keepable(optimizer: torch.optim.Optimizer | None, module: nn.Module, rank: int) -> None:
    """Refuse, naming the parameter and the key, per-element state that is not shaped like its parameter
    (a state_dict of another model loaded by index, say): no stage can cut it into its pieces -- and
    torch's own step would fail on it later, less clearly."""
    if optimizer is None:
        return
    names = {id(p): n for n, p in module.named_parameters()}
    for gi, group in enumerate(optimizer.param_groups):
        for i, p in enumerate(group["params"]):
            for key, value in optimizer.state.get(p, {}).items():
                if torch.is_tensor(value) and value.dim() > 0 and value.shape != p.shape:
                    name = names.get(id(p), f"param {i} of param group {gi}")
                    raise ValueError(
                        f"rank {rank}: the optimizer's state {key!r} of parameter {name!r} has shape "
                        f"{tuple(value.shape)}, but the parameter has shape {tuple(p.shape)}; a stage keeps the "
                        f"optimizer's state by cutting it into ranges of the parameter, which only works for state "
                        f"shaped like the parameter. Load a state_dict saved from this model's optimizer, or wrap "
                        f"an optimizer without state.")


def kept(entry: dict, start: int, stop: int, stepped: torch.Tensor) -> dict:
    """One parameter's state ``entry`` for the tensor ``stepped`` that steps ``[start, stop)`` of it: a piece
    (1-D) or a whole master (the parameter's shape)."""
    cut = flat_range(entry, start, stop, like=stepped)
    return {key: value.view(stepped.shape) if torch.is_tensor(value) and value.dim() > 0 else value
            for key, value in cut.items()}


def keep_state(user: torch.optim.Optimizer, rebuilt: torch.optim.Optimizer, stepped_of) -> None:
    """Move ``user``'s state into ``rebuilt``: ``stepped_of(param)`` lists ``(start, stop, tensor)`` -- the
    tensors ``rebuilt`` steps for ``param`` and the range of it each covers (none: this rank steps none of it)."""
    for group in user.param_groups:
        for p in group["params"]:
            entry = user.state.get(p)
            if entry:
                for start, stop, stepped in stepped_of(p):
                    rebuilt.state[stepped] = kept(entry, start, stop, stepped)
    user.state.clear()

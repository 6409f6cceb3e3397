"""The optimizers the lab trains with, by name, and what each keeps per parameter."""
from __future__ import annotations

import torch

OPTIMIZERS = {
    "sgd": lambda params, lr: torch.optim.SGD(params, lr=lr),
    "momentum": lambda params, lr: torch.optim.SGD(params, lr=lr, momentum=0.9),
    "nesterov": lambda params, lr: torch.optim.SGD(params, lr=lr, momentum=0.9, nesterov=True),
    "adam": lambda params, lr: torch.optim.Adam(params, lr=lr),
    "adamw": lambda params, lr: torch.optim.AdamW(params, lr=lr, weight_decay=0.1),
}


def make_optimizer(name: str, model: torch.nn.Module, lr: float, param_groups: bool = False,
                   over: torch.nn.Module | None = None) -> torch.optim.Optimizer:
    """``name`` over ``model``'s parameters -- or over ``over``'s, a stage wrapping it (the optimizer built after
    wrapping).  With ``param_groups``, two groups as in fine-tuning recipes: biases and norms without weight decay
    at twice the rate, the rest as given -- told apart by the parameters' full shapes, by name (a ZeRO piece is 1-D
    whatever its parameter is)."""
    if name not in OPTIMIZERS:
        raise ValueError(f"unknown optimizer {name!r}; choose one of {sorted(OPTIMIZERS)}")
    named = list((over or model).named_parameters())
    if not param_groups:
        return OPTIMIZERS[name]([p for _, p in named], lr)
    shapes = ({n: shape for n, (shape, _) in over.full_state_shapes().items()} if over is not None  # (ZeRO-3's model
              else {n: list(p.shape) for n, p in model.named_parameters()})                   # holds placeholders)
    vector = {n for n, shape in shapes.items() if len(shape) <= 1}
    named = [(n.removeprefix("module."), p) for n, p in named]  # a replicating stage's names are torch DDP's
    optimizer = OPTIMIZERS[name]([p for n, p in named if n not in vector], lr)
    optimizer.add_param_group({"params": [p for n, p in named if n in vector], "lr": 2 * lr, "weight_decay": 0.0})
    return optimizer


#: Full-size optimizer state tensors per parameter: Adam keeps m and v, momentum one buffer.
STATE_TENSORS = {"sgd": 0, "momentum": 1, "nesterov": 1, "adam": 2, "adamw": 2}

#: Full-size intermediates torch's *foreach* implementation (its default for CUDA tensors) makes at a step, each
#: a tensor list the size of every parameter it steps: Adam's and AdamW's square root of the second moment
#: (``torch._foreach_sqrt(exp_avg_sqs)``); SGD's, with or without momentum or Nesterov, works in place.  The
#: for-loop implementation (CPU tensors) makes its intermediates one parameter at a time.  torch.optim's docs:
#: foreach uses "~ sizeof(params) more peak memory" (torch/optim/optimizer.py); measured by tests/test_step_memory.py.
FOREACH_TEMPORARIES = {"sgd": 0, "momentum": 0, "nesterov": 0, "adam": 1, "adamw": 1}

#: The same of the for-loop implementation (CPU tensors), each the size of *one* tensor it steps, alive at once:
#: Adam's ``exp_avg_sq.sqrt()`` and its quotient by the bias correction (then added to in place); Nesterov's
#: ``grad.add(buf, alpha=momentum)``; plain SGD and momentum in place.  Measured by tests/test_step_memory.py.
LOOP_TEMPORARIES = {"sgd": 0, "momentum": 0, "nesterov": 1, "adam": 2, "adamw": 2}

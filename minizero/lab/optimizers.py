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


def make_optimizer(name: str, model: torch.nn.Module, lr: float, param_groups: bool = False) -> torch.optim.Optimizer:
    """``name`` over ``model``'s parameters.  With ``param_groups``, two groups as in fine-tuning
    recipes: biases and norms without weight decay at twice the rate, the rest as given."""
    if name not in OPTIMIZERS:
        raise ValueError(f"unknown optimizer {name!r}; choose one of {sorted(OPTIMIZERS)}")
    if not param_groups:
        return OPTIMIZERS[name](model.parameters(), lr)
    vectors = [p for p in model.parameters() if p.dim() <= 1]
    matrices = [p for p in model.parameters() if p.dim() > 1]
    optimizer = OPTIMIZERS[name](matrices, lr)
    optimizer.add_param_group({"params": vectors, "lr": 2 * lr, "weight_decay": 0.0})
    return optimizer


#: Full-size optimizer state tensors per parameter: Adam keeps m and v, momentum one buffer.
STATE_TENSORS = {"sgd": 0, "momentum": 1, "nesterov": 1, "adam": 2, "adamw": 2}

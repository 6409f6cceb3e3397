"""The stages, by name.  ``reference`` is single-device training: the truth."""
from __future__ import annotations

import torch
from torch import nn

from ..comm import Comm
from .base import Stage
from .wrap import broadcast_module, check_same_model
from .ddp import DDP
from .ddp_bucketed import BucketedDDP
from .zero1 import ZeRO1
from .zero2 import ZeRO2
from .zero3 import ZeRO3

STAGES: dict[str, type[Stage]] = {"reference": Stage, "ddp": DDP, "ddp-bucketed": BucketedDDP,
                                  "zero1": ZeRO1, "zero2": ZeRO2, "zero3": ZeRO3}


def check_stage_names(names: list[str], distributed_only: bool = False) -> None:
    valid = [n for n in STAGES if not (distributed_only and n == "reference")]
    unknown = [n for n in names if n not in valid]
    if unknown:
        raise ValueError(f"unknown stage(s) {unknown}; valid stages: {', '.join(valid)}"
                         + (" (the reference is what every stage is compared with)" if distributed_only else ""))
    if len(set(names)) != len(names):
        raise ValueError(f"a stage is named twice in {names}; name each once")
    if not names:
        raise ValueError(f"no stage given; valid stages: {', '.join(valid)}")


def make_stage(name: str, module: nn.Module, optimizer: torch.optim.Optimizer, comm: Comm | None = None,
               **options) -> Stage:
    """Wrap ``module`` and ``optimizer`` as stage ``name``."""
    check_stage_names([name])
    if name != "reference" and comm is None:
        raise ValueError(f"stage {name!r} communicates: pass a Comm (minizero.comm.make_comm)")
    return STAGES[name](module, optimizer, comm, **options) if name != "reference" else Stage(module, optimizer)


__all__ = ["BucketedDDP", "DDP", "ZeRO1", "ZeRO2", "ZeRO3", "STAGES", "Stage", "broadcast_module", "check_same_model", "check_stage_names", "make_stage"]

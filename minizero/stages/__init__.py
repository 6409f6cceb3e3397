"""The stages, by name.  ``reference`` is single-device training: the truth.

Adding a stage is one file in this package and one entry in :data:`STAGES`;
everything else -- ``compare``, the byte and memory checks, the CLI -- reads
the stage's facts from its class.
"""
from __future__ import annotations

import torch
from torch import nn

from ..comm import Comm
from .base import Stage
from .ddp import DDP
from .ddp_bucketed import BucketedDDP
from .facts import Reduction, Shards
from .hsdp import HSDP
from .local_sgd import LocalSGD
from .options import Option, check_declared, constructor_keywords, option_names
from .protocol import DataParallel
from .ps import ParameterServer
from .ps_async import AsyncParameterServer
from .wrap import broadcast_module, check_same_model
from .zero import ZeRO
from .zero1 import ZeRO1
from .zero2 import ZeRO2
from .zero3 import ZeRO3
from .zeropp import ZeROPlusPlus


def registry(*stages: type[Stage]) -> dict[str, type[Stage]]:
    """Stages by their ``name``, each checked: its declared options are its constructor's."""
    for stage in stages:
        check_declared(stage)
    return {stage.name: stage for stage in stages}


STAGES: dict[str, type[Stage]] = registry(Stage, DDP, BucketedDDP, ZeRO1, ZeRO2, ZeRO3, ZeROPlusPlus, HSDP, ParameterServer,
                                             AsyncParameterServer, LocalSGD)
REFERENCE = Stage.name  # single-device training: what every stage is compared with
DEFAULT_STAGE = DDP.name  # what a command runs when no stage is named


def distributed(stages: dict[str, type] | None = None) -> list[str]:
    """The names of the stages that communicate: all but the reference."""
    return [name for name, cls in (STAGES if stages is None else stages).items() if cls is not Stage]


def with_stages(*stages: type[Stage], base: dict[str, type[Stage]] = STAGES) -> dict[str, type[Stage]]:
    """A copy of ``base`` with ``stages`` added -- how tests and labs register a stage without
    touching the package's registry."""
    return {**base, **registry(*stages)}


def check_stage_names(names: list[str], distributed_only: bool = False, stages: dict | None = None) -> None:
    stages = STAGES if stages is None else stages
    valid = distributed(stages) if distributed_only else list(stages)
    unknown = [n for n in names if n not in valid]
    if unknown:
        raise ValueError(f"unknown stage(s) {unknown}; valid stages: {', '.join(valid)}"
                         + (" (the reference is what every stage is compared with)" if distributed_only else ""))
    if len(set(names)) != len(names):
        raise ValueError(f"a stage is named twice in {names}; name each once")
    if not names:
        raise ValueError(f"no stage given; valid stages: {', '.join(valid)}")


def make_stage(name: str, module: nn.Module, optimizer: torch.optim.Optimizer | None = None,
               comm: Comm | None = None, stages: dict | None = None, **options) -> Stage:
    """Wrap ``module`` (and ``optimizer``, if given: else build yours over ``stage.parameters()``).  ``options``
    by their declared names (the command line's: ``compress="fp16"``, ``offload_optimizer=True``), or a policy
    whole (``wire=WirePolicy("fp16")``)."""
    stages = STAGES if stages is None else stages
    check_stage_names([name], stages=stages)
    cls = stages[name]
    unknown = sorted(set(options) - set(option_names(cls)) - {o.into[0] for o in cls.options if o.into})
    if unknown:
        raise TypeError(f"stage {name!r} takes no option(s) {unknown}; its options: {', '.join(option_names(cls))}")
    keywords = constructor_keywords(cls, options)  # compress="fp16" -> wire=WirePolicy("fp16"): the policies
    return Stage(module, optimizer, **keywords) if cls is Stage else cls(module, optimizer, comm, **keywords)


__all__ = ["DEFAULT_STAGE", "REFERENCE", "STAGES", "AsyncParameterServer", "BucketedDDP", "DDP", "DataParallel", "HSDP",
           "LocalSGD", "Option", "ParameterServer", "Reduction", "Shards", "Stage", "ZeRO", "ZeRO1", "ZeRO2", "ZeRO3",
           "ZeROPlusPlus", "broadcast_module", "check_same_model", "check_stage_names", "distributed", "make_stage",
           "option_names", "registry", "with_stages"]

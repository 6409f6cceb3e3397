"""Everything the lab can run, by name: the package's stages and torch's own implementations.

Both kinds satisfy :class:`minizero.stages.DataParallel`, so the one training
loop drives them alike and nothing needs to probe what a stage can do.
"""
from __future__ import annotations

from ...stages import STAGES, Shards, Stage, check_stage_names, distributed, make_stage
from .oracle import ORACLES

LAB_STAGES = {**STAGES, **ORACLES}


def stage_class(name: str, stages: dict | None = None) -> type:
    stages = LAB_STAGES if stages is None else stages
    check_stage_names([name], stages=stages)
    return stages[name]


def build_stage(name: str, model, optimizer, comm, stages: dict | None = None, **options):
    """Stage ``name`` over ``model`` -- the reference when ``comm`` is None."""
    cls = stage_class(name, stages)
    if not issubclass(cls, Stage):  # torch's own, over the default process group
        return cls(model, optimizer, **options)
    return make_stage(name, model, optimizer, comm, stages=LAB_STAGES if stages is None else stages, **options)


def sharding(**what) -> list[str]:
    """The stages that shard exactly ``what`` (their own ``shards`` fact), the contrast stages aside: each
    bench measures every stage of a kind against torch's implementation of that kind, so a new stage is
    benchmarked with its kind (``bench all`` sets the contrast stages beside torch's DDP too)."""
    return [name for name in distributed() if STAGES[name].shards == Shards(**what) and not STAGES[name].contrast]


def accepting(option: str) -> list[str]:
    return [name for name in distributed() if option in STAGES[name].option_names()]

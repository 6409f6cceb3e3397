"""Factories for minizero's own stages: the calling convention ``verify`` asks of anyone's code, met by
``make_stage`` (``python -m minizero verify minizero/course/verify/minizero_stages.py:zero2``).

A factory is given the module and the process group -- no :class:`~minizero.comm.Comm` -- so it makes its own over
that group, as a user of the library does.  The stage is wrapped *without* the optimizer: the loop builds one over
``stage.parameters()`` (a ZeRO stage's owned pieces, under their parameters' names, as FSDP2's DTensors are) and
steps it itself; the stage's own ``zero_grad``, clipping and full state dict are what ``verify`` calls
(:class:`~minizero.course.verify.adapter.Yours`).

One factory per stage in the registry that is single-device training by design, runs on a flat network (HSDP's
mesh is where the ranks sit: it needs nodes) and is not one of the contrasts (``ps`` keeps the optimizer on its
servers, so it is wrapped *with* it), named as its ``--stage`` with ``_`` for ``-``.  A stage with buckets
gets tiny ones, so that an example's few parameters still fill several.
"""
from __future__ import annotations

from minizero.comm import make_comm
from minizero.stages import STAGES, Stage, make_stage, option_names

TINY_BUCKET_MB = 0.0001  # 100 bytes: a bucket per parameter or two


def stage_factory(name: str, backend: str = "native", **options):
    """A factory wrapping the module in stage ``name`` over ``backend``'s collectives on the group it is given."""
    def make_wrapper(module, group):
        return make_stage(name, module, comm=make_comm(backend, group=group), **options)
    make_wrapper.__name__ = name.replace("-", "_")
    make_wrapper.__doc__ = f"minizero's {name} over {backend} collectives" + (f", {options}" if options else "")
    return make_wrapper


FACTORIES = {factory.__name__: factory for factory in (
    stage_factory(name, **({"bucket_mb": TINY_BUCKET_MB} if "bucket_mb" in option_names(cls) else {}))
    for name, cls in STAGES.items()
    if cls is not Stage and cls.equivalent and not cls.contrast and not getattr(cls, "needs_nodes", False))}
globals().update(FACTORIES)  # each one importable by name: ``minizero_stages.py:zero2``

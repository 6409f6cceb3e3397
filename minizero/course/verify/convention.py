"""What ``verify`` asks of someone else's data-parallel code: a factory, and -- only where torch's idioms differ --
how to drive what it returns.

A *factory* is a function ``make_wrapper(module, group)`` (or ``make_wrapper(module)``) called on every rank with
the model and the process group it may use (``torch.distributed.group.WORLD``); it returns the wrapped module --
torch's ``DistributedDataParallel(module)``, ``fully_shard(module)``, a student's DDP class -- or a
:class:`Wrapped` that also says how to drive it where the defaults do not fit:

* **accumulation** is switched off by the wrapper's own ``no_sync()`` (torch DDP's, a student's), else by FSDP2's
  ``set_requires_gradient_sync(False)``; a wrapper with neither is verified at K = 1 only, and says so;
* the **optimizer** is the one the loop built over the model's parameters -- rebuilt by name when wrapping
  replaced them (FSDP2's DTensors, a ZeRO stage's owned pieces) -- unless ``optimizer`` builds another from it
  (``ZeroRedundancyOptimizer``);
* **full parameters** are read from the model as the factory left it, a DTensor's ``full_tensor()`` taken;
  a wrapper that keeps its own shards says how with ``full_parameters``;
* ``before_step`` runs once a step before the gradients are read -- clipped or stepped (a course's
  ``finish_gradient_synchronization()``);
* gradients are clipped by ``torch.nn.utils.clip_grad_norm_`` over the model's parameters (DTensors included),
  unless ``clip_grad_norm(max_norm, norm_type)`` clips them otherwise (a wrapper of its own shards);
* minizero's own stages (``make_stage`` in a factory) are driven through their own ``zero_grad``, clipping and
  full state dict (:mod:`.minizero_stages`);
* ``unused_parameters``: the wrapper accepts parameters without a gradient in a step (torch DDP's
  ``find_unused_parameters=True``): then models with such parameters are drawn too;
* ``compress``: the 16-bit dtype its gradients cross the wire in (``"fp16"``, ``"bf16"``: torch's
  ``fp16_compress_hook``, ``bf16_compress_hook``); ``precision``: its mixed precision (``"bf16"``, or the
  ``MixedPrecisionPolicy`` given to FSDP2's ``fully_shard``).  Either is judged against the reference that applies
  the same casts, within a few times their own effect (:mod:`.declared_casts`).
"""
from __future__ import annotations

import contextlib
import importlib.util
import inspect
import os
from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn

from ...parts.precision import Precision
from .declared_casts import Casts, declared_casts

#: The factory's name in a file when ``verify path.py`` names none.
DEFAULT_FACTORY = "make_wrapper"


@dataclass
class Wrapped:
    module: nn.Module
    no_sync: Callable[[], contextlib.AbstractContextManager] | None = None
    optimizer: Callable[[torch.optim.Optimizer], torch.optim.Optimizer] | None = None
    full_parameters: Callable[[], dict[str, torch.Tensor]] | None = None
    before_step: Callable[[], None] | None = None
    clip_grad_norm: Callable[[float, float], torch.Tensor] | None = None
    unused_parameters: bool = False
    compress: str | None = None
    precision: "str | Precision | None" = None  # "bf16", a Precision, or the MixedPrecisionPolicy given to fully_shard

    def __post_init__(self):
        if not isinstance(self.module, nn.Module):
            raise TypeError(f"the factory returned {type(self.module).__name__}, not an nn.Module: return the wrapped "
                            f"module (or minizero.course.verify.Wrapped(module, ...))")
        if self.no_sync is None:
            self.no_sync = accumulation_switch(self.module)
        declared_casts(self.compress, self.precision)  # refused here, in words, if it cannot be judged

    @property
    def casts(self) -> Casts | None:
        """What the wrapper rounds on purpose, as the reference that rounds the same way."""
        return declared_casts(self.compress, self.precision)


def accumulation_switch(module: nn.Module) -> Callable[[], contextlib.AbstractContextManager] | None:
    """How to run a backward that does not synchronise: the module's ``no_sync()``, FSDP2's switch, or None."""
    if callable(getattr(module, "no_sync", None)):
        return module.no_sync
    if callable(getattr(module, "set_requires_gradient_sync", None)):
        @contextlib.contextmanager
        def no_sync():
            module.set_requires_gradient_sync(False)
            try:
                yield
            finally:
                module.set_requires_gradient_sync(True)
        return no_sync
    return None


def split_spec(spec: str) -> tuple[str, str]:
    """``"path.py:name"`` (or ``"path.py"``: :data:`DEFAULT_FACTORY`) as ``(absolute path, name)``."""
    path, _, name = spec.rpartition(":") if spec.rpartition(":")[2].isidentifier() else (spec, "", "")
    return os.path.abspath(path), name or DEFAULT_FACTORY


def load_factory(spec: str) -> Callable:
    """The factory ``spec`` names, imported from its file; a missing file, a missing name or something that
    cannot be called is refused, saying what to write."""
    path, name = split_spec(spec)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"verify {spec}: no file {path}; write 'path/to/file.py:factory_name'")
    loader = importlib.util.spec_from_file_location(f"minizero_verified_{abs(hash(path))}", path)
    module = importlib.util.module_from_spec(loader)
    loader.loader.exec_module(module)
    factory = getattr(module, name, None)
    if not callable(factory):
        found = sorted(n for n, v in vars(module).items() if callable(v) and not n.startswith("_")
                       and getattr(v, "__module__", None) == module.__name__)
        raise ValueError(f"verify {spec}: {path} defines no function {name!r}"
                         + (f" (it defines {', '.join(found)}: name one, as {os.path.basename(path)}:{found[0]})"
                            if found else ""))
    return factory


def call_factory(factory: Callable, module: nn.Module, group) -> Wrapped:
    """The factory's result on ``module`` as a :class:`Wrapped` (given the group if it takes a second argument)."""
    takes = [p for p in inspect.signature(factory).parameters.values()
             if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) and p.default is p.empty]
    out = factory(module, group) if len(takes) >= 2 else factory(module)
    return out if isinstance(out, Wrapped) else Wrapped(out)

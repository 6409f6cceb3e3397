"""Someone's wrapper behind minizero's stage interface, so the one training loop -- and so the whole property
suite -- drives it as it drives every stage and torch's own (:mod:`minizero.course.harness.oracle`)."""
from __future__ import annotations

import torch

from ...parts.rebuilt import rebuild
from ...stages import Stage
from ..harness.oracle import TorchStage
from .convention import call_factory, load_factory


def full(tensor: torch.Tensor) -> torch.Tensor:
    """A DTensor's whole value (FSDP2's parameters); any other tensor as it is."""
    return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor


def own_stage(module) -> bool:
    """Is ``module`` one of minizero's stages (``make_stage(...)`` in a factory)?  Then it is driven through its
    own methods, as a user of it would: its full state dict, its clipping, its ``zero_grad``."""
    return isinstance(module, Stage)


class Yours(TorchStage):
    """The stage ``verify`` runs: built on every rank by the factory ``factory`` names (``"path.py:name"``)."""

    name = "yours"

    def __init__(self, module, optimizer, comm=None, factory: str = "", **_):
        names = {id(p): n for n, p in module.named_parameters()}
        self.wrapped = call_factory(load_factory(factory), module, torch.distributed.group.WORLD)
        self.model = module  # as the factory left it: FSDP2 shards its parameters in place, DDP holds it
        self.own = own_stage(self.wrapped.module)
        # What the optimizer steps: the module's parameters, or -- where wrapping replaced them (FSDP2's DTensors,
        # a ZeRO stage's owned pieces, each under its parameter's name) -- the wrapper's, found by name.
        stepped = dict((self.wrapped.module if self.own else module).named_parameters())
        if self.wrapped.optimizer is not None:
            optimizer = self.wrapped.optimizer(optimizer)
        elif any(id(p) not in names for p in stepped.values()):
            optimizer = rebuild(type(optimizer), optimizer.defaults, optimizer.param_groups,
                                [[stepped.get(names[id(p)], p) for p in g["params"]] for g in optimizer.param_groups])
        super().__init__(self.wrapped.module, optimizer)
        self._finished = False

    def zero_grad(self, set_to_none: bool = True):
        super().zero_grad(set_to_none)
        if self.own:  # a stage's own buffers (a bucket's, ZeRO's flat gradients) are zeroed by the stage
            self.wrapped.module.zero_grad(set_to_none)

    def no_sync(self):
        if self.wrapped.no_sync is None:
            raise RuntimeError("this wrapper has no way to accumulate without synchronising (no no_sync(), no "
                               "set_requires_gradient_sync): verify draws K = 1 for it")
        return self.wrapped.no_sync()

    def _finish(self) -> None:
        """The wrapper's ``before_step``, once a step, before anything reads the gradients (clipping does first)."""
        if self.wrapped.before_step is not None and not self._finished:
            self.wrapped.before_step()
        self._finished = True

    def step(self):
        self._finish()
        super().step()
        self._finished = False

    def full_state_dict(self) -> dict:
        if self.wrapped.full_parameters is not None:
            return {n: t.detach().clone() for n, t in self.wrapped.full_parameters().items()}
        if self.own:  # ZeRO-3's parameters are placeholders outside a forward: the stage gathers them
            names = {n for n, _ in self.model.named_parameters()}
            return {n: t for n, t in self.wrapped.module.full_state_dict().items() if n in names}
        return {n: full(p).detach().clone() for n, p in self.model.named_parameters()}

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        self._finish()
        if self.wrapped.clip_grad_norm is not None:
            return full(self.wrapped.clip_grad_norm(max_norm, norm_type))
        if self.own:  # a sharded stage's gradients are pieces: its norm is taken over every rank's
            return self.wrapped.module.clip_grad_norm_(max_norm, norm_type)
        return full(torch.nn.utils.clip_grad_norm_(list(self.model.parameters()), max_norm, norm_type))

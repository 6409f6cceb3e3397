"""A stage's state, out and in: whole state dicts for anyone, parts for a sharded checkpoint.

Out: ``stage.full_state_dict()`` and ``stage.full_optimizer_state_dict()`` are what a plain model and
optimizer on one device would hold (ZeRO gathers them); ``stage.owned_parts()`` is what this rank alone
holds, as ranges of the parameters (:mod:`minizero.parts.part`), written with no communication.  In:
``load_full_state_dict`` and ``load_full_optimizer_state_dict`` take whole state dicts -- from any stage at
any world size -- and keep what this stage holds of them, which is all resharding needs (:mod:`minizero.checkpoint`).

The reference and ``ddp`` hold everything, so what is here is theirs: methods of
:class:`~minizero.stages.base.Stage` (``self`` is the stage: its ``module``, ``optimizer``, ``master`` under
mixed precision, ``master_optimizer`` and ``_frozen``), written here so the stage's file reads as its
lifecycle.  ZeRO overrides them for its flat shards (:mod:`minizero.stages.zero`).
"""
from __future__ import annotations

import torch

from ..parts.masters import in_users_order
from ..parts.part import Part, flat_range
from ..parts.rebuilt import follow, settings


def check_checkpointable(cls, rank: int = 0) -> None:
    """A class method: ``train --save`` refuses such a stage before it trains, not after."""
    if cls.why_not_checkpointable:
        raise ValueError(f"rank {rank}: stage {cls.name!r} cannot be checkpointed: {cls.why_not_checkpointable}, "
                         f"which no single-device state describes. Train it without --save (it can resume from "
                         f"another stage's checkpoint).")

def full_state_dict(self) -> dict[str, torch.Tensor]:
    """The unwrapped model's state_dict, every value whole (ZeRO-3 gathers it); every rank gets it.
    Under mixed precision the parameters are the fp32 masters -- the weights; the 16-bit copy is a cast."""
    state = {k: v.detach().clone() for k, v in self.module.state_dict().items()}
    return self._with_masters(state, self._master_values() if self.master else {})

def master_values(self) -> dict[int, torch.Tensor]:
    """``id(parameter)`` -> its whole fp32 master (the reference and ddp hold them whole)."""
    return {id(w): m.detach().clone() for w, m in zip(self.master.working, self.master.masters, strict=True)}

def with_masters(self, state: dict, masters: dict[int, torch.Tensor]) -> dict:
    if self.master is None:
        return state
    for name, p in self.module.named_parameters(remove_duplicate=False):
        value = masters.get(id(p), self._frozen.get(id(p)))  # a frozen parameter: its value before the cast
        state[name] = value.clone() if value is not None else state[name]
    return state

def full_optimizer_state_dict(self) -> dict:
    """What a plain torch optimizer over the unwrapped model would hold (ZeRO consolidates it)."""
    if self.master is not None and self.optimizer is not None:
        return in_users_order(self.master_optimizer, self.optimizer, self.master)
    return self.optimizer.state_dict() if self.optimizer is not None else {}

# ------------------------------------------------------------------ checkpoints: parts and loading
def sharded_names(self) -> list[str]:
    """The parameters :meth:`owned_parts` covers (those the optimizer steps); every rank gives the same list."""
    return [n for n, _ in self.trainable()]

def full_state_shapes(self) -> dict[str, tuple[list[int], str]]:
    """``name -> (shape, dtype)`` of every value :meth:`full_state_dict` returns, computed from what this rank
    holds (nothing gathered): what a checkpoint is checked against before anything is loaded."""
    return {name: self._full_shape(tensor) for name, tensor in self.module.state_dict(keep_vars=True).items()}

def full_shape(self, tensor: torch.Tensor) -> tuple[list[int], str]:
    if self.master and id(tensor) in self.master._master_of:
        return list(tensor.shape), str(self.master.masters_dtype)
    return list(tensor.shape), str(self._frozen.get(id(tensor), tensor).dtype)

def owned_parts(self) -> list[Part]:
    """What this rank writes to a sharded checkpoint.  Every rank of the reference and ddp holds every
    parameter whole, so rank 0 writes them and the others nothing (DCP deduplicates replicas the same way)."""
    optimizer = self._require_optimizer("owned_parts")
    if self.rank != 0:
        return []
    stepped = self.master.master_of if self.master else (lambda p: p)
    stepper = self.master_optimizer if self.master else optimizer
    return [Part(n, 0, p.numel(), stepped(p).detach().reshape(-1).clone(),
                 flat_range(stepper.state.get(stepped(p)), 0, p.numel()))
            for n, p in self.trainable()]

@torch.no_grad()
def load_full_state_dict(self, state: dict[str, torch.Tensor]) -> None:
    """Set the model to a whole (consolidated) state_dict -- what :meth:`full_state_dict` returns, from any
    stage at any world size; under mixed precision the masters take the values and the model their cast."""
    self._load_module_tensors(state)
    if self.master:
        names = {id(p): n for n, p in self.module.named_parameters()}
        for w, m in zip(self.master.working, self.master.masters, strict=True):
            m.copy_(state[names[id(w)]])

def load_module_tensors(self, state: dict, skip: set[str] = frozenset()) -> None:
    """Copy ``state`` into the module's parameters and buffers (not ``skip``), cast to what each is now;
    a frozen parameter kept at full precision under mixed precision takes the value itself."""
    for name, tensor in [*self.module.named_parameters(), *self.module.named_buffers()]:
        if name in skip:
            continue
        if id(tensor) in self._frozen:
            self._frozen[id(tensor)] = state[name].detach().to(self._frozen[id(tensor)].dtype, copy=True)
        tensor.copy_(state[name])

def load_full_optimizer_state_dict(self, saved: dict) -> None:
    """Load what :meth:`full_optimizer_state_dict` returns -- a plain optimizer's state_dict over the
    unwrapped model, indexed in the user's parameter order -- into this stage's optimizer."""
    optimizer = self._require_optimizer("load_full_optimizer_state_dict")
    if self.master is None:
        optimizer.load_state_dict(saved)
        return
    # The rebuilt optimizer steps the masters, one group per user group: re-index the saved state by them.
    follow(optimizer, saved["param_groups"])
    order = [p for group in optimizer.param_groups for p in group["params"]]
    position = {id(self.master.master_of(p)): i for i, p in enumerate(order) if p.requires_grad}
    masters = [m for group in self.master_optimizer.param_groups for m in group["params"]]
    state = {j: saved["state"][position[id(m)]] for j, m in enumerate(masters) if position[id(m)] in saved["state"]}
    groups, j = [], 0
    for kept, group in zip(saved["param_groups"], self.master_optimizer.param_groups, strict=True):
        groups.append({**settings(kept), "params": list(range(j, j + len(group["params"])))})
        j += len(group["params"])
    self.master_optimizer.load_state_dict({"state": state, "param_groups": groups})


# ------------------------------------------------------------------ what this rank holds now
def full_gradients(self) -> dict[str, torch.Tensor | None]:
    """Every trainable parameter's (averaged) gradient in its full shape, by name: here each rank holds
    them whole (ZeRO gathers them from the pieces) -- under mixed precision with the optimizer built after
    wrapping, the fp32 masters' gradients, which that optimizer steps."""
    outside = self.masters_outside
    return {n: None if g is None else g.detach().clone()
            for n, p in self.trainable() for g in [(self.master.master_of(p) if outside else p).grad]}


def held_tensors(self) -> dict[str, list[torch.Tensor]]:
    """The model state this rank keeps between steps, by kind -- what memory accounting walks."""
    params = [p for _, p in self.trainable()]
    return {"params": params,
            "grads": [p.grad for p in params if p.grad is not None],
            "master": self.master.masters if self.master else [],
            "optimizer": optimizer_tensors(getattr(self, "master_optimizer", self.optimizer))}


def optimizer_tensors(optimizer: torch.optim.Optimizer | None) -> list[torch.Tensor]:
    return [t for state in optimizer.state.values() for t in state.values() if torch.is_tensor(t)] if optimizer else []

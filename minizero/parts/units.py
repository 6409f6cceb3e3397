"""ZeRO-3 units: which submodules gather their parameters together.

A unit is the granularity of ZeRO-3 (FSDP's ``fully_shard``): its
parameters are gathered just before it computes and freed just after, so the
full weights of only a unit or two exist at any time.  The default, like
wrapping every transformer block: each element of every ``nn.ModuleList``
becomes a unit; everything else belongs to the root unit (index 0).

A parameter used by two units -- an input embedding tied to the output head --
belongs to the root, which is gathered for the whole forward and again for
the whole backward, so both uses see it and its gradient is complete before
it is reduced.  (Assigning it to one of the two units is how tied weights end up
half-updated.)
"""
from __future__ import annotations

from typing import Callable

from torch import nn

from ..comm import Work
from .layout import ShardedFlatGroup, plan_groups


def default_units(model: nn.Module) -> list[nn.Module]:
    units: list[nn.Module] = []
    inside: set[int] = set()
    for module in model.modules():
        if isinstance(module, nn.ModuleList) and id(module) not in inside:
            for child in module:
                units.append(child)
                inside.update(id(m) for m in child.modules())
    return units


def resolve_units(model: nn.Module, units) -> list[nn.Module]:
    """Units given as modules or as submodule names ("blocks.0"); default if None."""
    if units is None:
        return default_units(model)
    resolved = [model.get_submodule(u) if isinstance(u, str) else u for u in units]
    for i, a in enumerate(resolved):
        if a is model:
            raise ValueError("the root module is always a unit of its own; list only submodules as units")
        for b in resolved[i + 1:]:
            if a is b or any(m is b for m in a.modules()) or any(m is a for m in b.modules()):
                raise ValueError(f"units must not contain one another: {type(a).__name__} and {type(b).__name__}")
    return resolved


def replicated_parameters(model: nn.Module, replicate, rank: int = 0) -> set[int]:
    """The trainable parameters of the modules (or submodule names) in ``replicate``, by ``id``: kept whole on
    every rank, all-reduced, not sharded.  A parameter a replicated module shares with a sharded one (a tied
    weight) is refused: it would be both."""
    if not replicate:
        return set()
    modules = [model.get_submodule(m) if isinstance(m, str) else m for m in replicate]
    if any(m is model for m in modules):
        raise ValueError(f"rank {rank}: replicate names the whole model: that is ddp, not zero3; list the submodules "
                         f"to keep whole on every rank")
    inside = {id(m) for module in modules for m in module.modules()}
    module_names = {id(m): n for n, m in model.named_modules()}
    replicated = {id(p): f"{module_names[id(module)]}.{n}" for module in modules
                  for n, p in module.named_parameters() if p.requires_grad}
    for name, module in model.named_modules():
        if id(module) not in inside:
            for pname, p in module.named_parameters(recurse=False):
                if id(p) in replicated:
                    raise ValueError(
                        f"rank {rank}: parameter {name + '.' + pname!r} of module {name!r}, which is sharded, is also "
                        f"a replicated module's ({replicated[id(p)]!r}, a tied weight): it cannot be both. Replicate "
                        f"{name!r} too, or neither")
    return set(replicated)


def assign_parameters(model: nn.Module, units: list[nn.Module]) -> list[list[tuple[str, nn.Parameter]]]:
    """Trainable parameters per unit; index 0 is the root: parameters outside every unit,
    and parameters used from more than one unit (tied weights)."""
    unit_of_module = {}
    for index, unit in enumerate(units, start=1):
        for module in unit.modules():
            unit_of_module[id(module)] = index
    users: dict[int, set[int]] = {}
    for module in model.modules():
        for p in module._parameters.values():
            if p is not None:
                users.setdefault(id(p), set()).add(unit_of_module.get(id(module), 0))
    assigned: list[list[tuple[str, nn.Parameter]]] = [[] for _ in range(len(units) + 1)]
    for name, p in model.named_parameters():
        if p.requires_grad:
            owners = users[id(p)]
            assigned[next(iter(owners)) if len(owners) == 1 else 0].append((name, p))
    return assigned


def plan_unit_groups(model: nn.Module, units: list[nn.Module], param_groups: list[list[nn.Parameter]]):
    """ZeRO-3's flat groups: per unit, per optimizer param group, per dtype -- the last unit first
    (the order backward finishes them).  Returns ``(unit, param group index, [(name, param)])``."""

    in_group = {id(p): gi for gi, params in enumerate(param_groups) for p in params}
    per_unit = assign_parameters(model, units)
    plan = []
    for unit in reversed(range(len(per_unit))):
        named = [(n, p) for n, p in per_unit[unit] if id(p) in in_group]
        names = {id(p): n for n, p in named}
        by_group = [[p for _, p in named if in_group[id(p)] == gi] for gi in range(len(param_groups))]
        plan += [(unit, gi, [(names[id(p)], p) for p in params]) for gi, params in plan_groups(by_group)]
    return plan


class Unit:
    """One ZeRO-3 unit at run time -- FSDP2's ``FSDPParamGroup``: the flat groups of its parameters and
    the all-gather in flight for them, with a method for each moment it acts, named as FSDP2 names them.
    ``all_gather(unit, why)`` is the stage's: it starts the unit's all-gather on the communication thread and
    returns the work, whose result is one full buffer per group (:meth:`minizero.stages.ZeRO3.all_gather`).

    ``observe(event, nbytes, unit)`` hears every ``"gather"`` (a full buffer allocated -- counted from the
    moment the all-gather starts, so a prefetch takes memory while it runs) and every ``"free"``, with this
    unit's index: instrumentation outside the algorithm, like the byte ledger."""

    def __init__(self, index: int, name: str, groups: list[ShardedFlatGroup],
                 all_gather: Callable[["Unit", str], Work], observe: Callable[[str, int, int], None]):
        self.index, self.name, self.groups = index, name, groups
        self._all_gather, self._observe = all_gather, observe
        self._gathering = None  # the all-gather running on the communication thread, if any

    @property
    def label(self) -> str:
        return f"unit {self.index} ({self.name})"

    @property
    def gathered(self) -> bool:
        return all(g.gathered for g in self.groups)

    # ------------------------------------------------------------ the moments
    def pre_forward(self) -> None:
        self.unshard("forward")

    def post_forward(self, reshard: bool) -> None:
        if reshard:
            self.reshard()

    def pre_backward(self) -> None:
        """Autograd saved the parameters and views of their buffer (``weight.t()``): the gather refills that
        buffer's storage, freed in place at reshard, so both see the gathered values."""
        self.unshard("backward")

    def post_backward(self, group: ShardedFlatGroup) -> None:
        """``group``'s gradients are packed for their reduce-scatter: its full parameters can go."""
        self._free(group)

    # ------------------------------------------------------------ gathering and freeing
    def start_gather(self, why: str) -> None:
        """Start the all-gather on the communication thread (now, or as a prefetch)."""
        if self._gathering is not None or self.gathered:
            return
        self._gathering = self._all_gather(self, why)
        for g in self.groups:
            self._observe("gather", g.full_bytes, self.index)

    def unshard(self, why: str) -> None:
        """Full parameters, now: start the all-gather unless a prefetch did, and wait for it."""
        self.start_gather(why)
        if self._gathering is not None:
            for group, full in zip(self.groups, self._gathering.result(), strict=True):
                group.use(full)
            self._gathering = None

    def drop_prefetch(self) -> None:
        """A prefetch nobody used (the order came from the last forward): wait for it, then free it --
        after the optimizer step it would hold stale weights."""
        if self._gathering is not None:
            self._gathering.wait()
            self._gathering = None
            for g in self.groups:
                self._observe("free", g.full_bytes, self.index)
                g.reshard()  # its buffer's memory: never pointed to, freed all the same

    def reshard(self) -> None:
        for group in self.groups:
            self._free(group)

    def _free(self, group: ShardedFlatGroup) -> None:
        if group.gathered:
            self._observe("free", group.full_bytes, self.index)
            group.reshard()

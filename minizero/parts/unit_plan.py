"""ZeRO-3's units, planned at wrap time: which submodules gather their parameters together, and which parameters
each holds.

The default, like wrapping every transformer block with FSDP's ``fully_shard``: each element of every
``nn.ModuleList`` becomes a unit; everything else belongs to the root unit (index 0).

A parameter used by two units -- an input embedding tied to the output head -- belongs to the root, which is
gathered for the whole forward and again for the whole backward, so both uses see it and its gradient is complete
before it is reduced.  (Assigning it to one of the two units is how tied weights end up half-updated.)
"""
from __future__ import annotations

from torch import nn

from .layout import FlatGroup, plan_groups


class ReplicatedGroup(FlatGroup):
    """Parameters every rank holds whole inside a sharded model -- FSDP2's modules left outside
    ``fully_shard``: laid out as a group of one rank, so this rank "owns" all of it (its pieces are the
    whole parameters, which the sharded optimizer steps on every rank alike), and its gradients are
    all-reduced instead of reduce-scattered."""

    replicated = True

    def __init__(self, named_params: list[tuple[str, nn.Parameter]], group_index: int = 0):
        super().__init__(named_params, 0, 1, group_index)


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


def plan_units(model: nn.Module, units, replicate, param_groups: list[list[nn.Parameter]], rank: int = 0):
    """ZeRO-3's layout, planned: ``(unit modules, sharded, replicated)`` -- one sharded group per unit, param group
    and dtype, the last unit first (backward's order), as ``(owner unit, group index, named parameters)``; then
    the parameters of the ``replicate`` modules, whole on every rank, as ``(group index, parameters)``."""
    unit_modules, whole = resolve_units(model, units), replicated_parameters(model, replicate, rank)
    sharded = plan_unit_groups(model, unit_modules, [[p for p in g if id(p) not in whole] for g in param_groups])
    return unit_modules, sharded, plan_groups([[p for p in g if id(p) in whole] for g in param_groups])


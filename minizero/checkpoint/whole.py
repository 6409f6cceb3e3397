"""A checkpoint's contents as one device's state: the whole model state_dict joined from every rank's parts,
and the optimizer's state keyed by parameter *name* -- positions differ between a stage's optimizer and a plain
one, and between runs that built their parameter groups in another order."""
from __future__ import annotations

from pathlib import Path

import torch

from ..parts.part import Part
from .files import CheckpointError


# ---------------------------------------------------------------------- sharded: the whole state from the parts
def assemble(stage, manifest: dict, payloads: list[dict], directory: Path) -> tuple[dict, dict]:
    """The whole model state_dict and the optimizer state by parameter name, from every rank's parts."""
    parts: dict[str, list[Part]] = {}
    for payload in payloads:
        for name, start, stop, value, state in payload["parts"]:
            parts.setdefault(name, []).append(Part(name, start, stop, value, state))
    model, optimizer_state = dict(payloads[0]["rest"]), {}
    for name in manifest["sharded"]:
        shape, dtype = manifest["state"][name]
        numel = int(torch.Size(shape).numel())
        held = sum(p.stop - p.start for p in parts.get(name, []))
        if held != numel:
            raise CheckpointError(f"{directory}: holds {held} of the {numel} elements of '{name}'; a rank's file is "
                                  f"not the one the manifest was written with -- resume from an earlier checkpoint")
        model[name] = _join([(p.start, p.stop, p.value) for p in parts[name]], numel, getattr(torch, dtype[6:]))
        model[name] = model[name].view(shape)
        if any(p.state for p in parts[name]):
            optimizer_state[name] = _join_state(parts[name], numel, shape)
    for alias, name in payloads[0]["rest"].get("__aliases__", {}).items():
        model[alias] = model[name]
    model.pop("__aliases__", None)
    return model, {"state": optimizer_state, "param_groups": payloads[0]["optimizer_groups"]}


def _join(ranges: list[tuple[int, int, torch.Tensor]], numel: int, dtype: torch.dtype) -> torch.Tensor:
    full = torch.empty(numel, dtype=dtype)
    for start, stop, value in ranges:
        full[start:stop] = value.reshape(-1)
    return full


def _join_state(parts: list[Part], numel: int, shape) -> dict:
    """One parameter's optimizer state: per-element tensors joined from their ranges, scalars from any part."""
    entry = {}
    for key, value in next(p.state for p in parts if p.state).items():
        if torch.is_tensor(value) and value.dim() > 0:
            entry[key] = _join([(p.start, p.stop, p.state[key]) for p in parts], numel, value.dtype).view(shape)
        else:
            entry[key] = value
    return entry


def rest(stage) -> dict:
    """What no stage shards: buffers and frozen parameters (their values before any cast), and which names
    are aliases of a tied parameter."""
    sharded = set(stage.sharded_names())
    first, aliases = {}, {}
    for name, p in stage.module.named_parameters(remove_duplicate=False):
        aliases[name] = first.setdefault(id(p), name)
    full = stage._with_masters({k: v.detach().clone() for k, v in stage.module.state_dict().items()}, {})
    rest = {k: v for k, v in full.items() if k not in sharded and aliases.get(k, k) == k}
    rest["__aliases__"] = {k: v for k, v in aliases.items() if k != v}
    return rest


# ---------------------------------------------------------------------- the optimizer, by parameter name
def optimizer_names(stage) -> list[list[str]]:
    names = {id(p): n for n, p in stage.module.named_parameters()}
    return [[names[id(p)] for p in group["params"]] for group in stage.optimizer.param_groups]


def optimizer_groups(stage) -> list[dict]:
    return [{**{k: v for k, v in group.items() if k != "params"}, "params": names}
            for group, names in zip(stage.optimizer.param_groups, optimizer_names(stage), strict=True)]


def by_name(saved: dict, names: list[list[str]]) -> dict:
    """A plain optimizer state_dict (indexed by position) re-keyed by parameter name."""
    flat = [n for group in names for n in group]
    return {"state": {flat[i]: entry for i, entry in saved["state"].items()},
            "param_groups": [{**{k: v for k, v in g.items() if k != "params"}, "params": group}
                             for g, group in zip(saved["param_groups"], names, strict=True)]}


def indexed(saved: dict, names: list[list[str]], directory: Path) -> dict:
    """The reverse, in *this* run's parameter order, so it loads whatever order the optimizer was built in."""
    if [sorted(g["params"]) for g in saved["param_groups"]] != [sorted(g) for g in names]:
        raise CheckpointError(f"{directory}: the optimizer's parameter groups differ from this run's "
                              f"({[len(g['params']) for g in saved['param_groups']]} parameters per group saved, "
                              f"{[len(g) for g in names]} here); build the optimizer as the saved run did")
    position = {n: i for i, n in enumerate(n for group in names for n in group)}
    return {"state": {position[n]: entry for n, entry in saved["state"].items()},
            "param_groups": [{**{k: v for k, v in g.items() if k != "params"}, "params": [position[n] for n in group]}
                             for g, group in zip(saved["param_groups"], names, strict=True)]}

"""Checkpoints for every stage: save at N ranks, load at M, from any stage into any stage.

**Sharded** (the default): each rank writes what it owns -- :meth:`Stage.owned_parts`, ranges of the
*parameters* with their optimizer state -- with no communication beyond a file-size exchange; rank 0 adds
the buffers, frozen parameters and optimizer hyper-parameters.  **Consolidated**: the whole model and
optimizer state_dicts gathered (``full_state_dict``), one file a plain PyTorch user loads::

    state = torch.load("step-00000020/consolidated.pt")
    model.load_state_dict(state["model"]); optimizer.load_state_dict(state["optimizer"])

Loading either kind assembles the whole state_dicts a single device would hold and hands them to
:meth:`Stage.load_full_state_dict` and ``load_full_optimizer_state_dict``: each stage keeps its own part.
That is the whole of resharding -- ZeRO-3 on 4 ranks to ``ddp`` on 3 is the same call as resuming in place
-- at the cost of every rank reading the whole state once (DCP reads only the slices a rank owns; see the
README for why minizero writes its own format).  The manifest carries what a resumed run must continue
from exactly: the step, the precision and loss-scaler state, each rank's RNG, the data position.
"""
from __future__ import annotations

import secrets
import time
from pathlib import Path

import torch

from ..comm import Tag
from ..parts import Part
from .files import (
    CONSOLIDATED,
    MANIFEST,
    CheckpointError,
    find,
    load_file,
    rank_file,
    read_manifest,
    save_tensors,
    step_dir,
    write_manifest,
)

__all__ = ["CheckpointError", "save", "load", "inspect", "find"]


def save(stage, root: str | Path, step: int, *, consolidated: bool = False, data: dict | None = None) -> Path:
    """Save ``stage`` (every rank calls this) as checkpoint ``step`` under ``root``; returns its directory.
    ``data``: what the training loop needs to continue (its position, seed, batch size), kept in the manifest."""
    _require_optimizer(stage)  # before anything is written
    stage.check_checkpointable(stage.rank)
    comm, rank, world_size = stage.comm, stage.rank, stage.world_size
    directory = step_dir(root, step)
    directory.mkdir(parents=True, exist_ok=True)  # every rank: nodes need not share a file system
    if rank == 0:  # saving a step again: its old manifest goes first, so an interrupted save never loads
        (directory / MANIFEST).unlink(missing_ok=True)
    save_id = _everyones(comm, secrets.randbits(52) if rank == 0 else 0)[0]  # also the barrier after the unlink
    if consolidated:
        model, optimizer = stage.full_state_dict(), stage.full_optimizer_state_dict()  # collectives: every rank
        name, payload = CONSOLIDATED, {"model": model, "optimizer": optimizer, "param_names": _optimizer_names(stage)}
    else:
        name = rank_file(rank, world_size)
        payload = {"parts": [(p.name, p.start, p.stop, p.value, p.state) for p in stage.owned_parts()],
                   "residuals": dict(stage.wire.residuals) if _wire(stage) else {}}
        if rank == 0:
            payload["rest"] = _rest(stage)
            payload["optimizer_groups"] = _optimizer_groups(stage)
    failure, size = None, 0
    if rank == 0 or not consolidated:
        try:
            size = save_tensors(directory / name, {**payload, "save_id": save_id, "rng": _rng_state()})
        except Exception as error:  # noqa: BLE001 -- the others must hear of it, not wait for it
            failure, size = error, -1
    sizes = _everyones(comm, size)
    if failure is not None:
        raise failure
    if min(sizes) < 0:
        raise CheckpointError(f"{directory}: rank(s) {[r for r, s in enumerate(sizes) if s < 0]} could not write their "
                              f"file, so this save was not completed; the previous checkpoint stands")
    files = {CONSOLIDATED: sizes[0]} if consolidated else {rank_file(r, world_size): s for r, s in enumerate(sizes)}
    if rank == 0:
        scaler = stage.master.scaler if stage.master and stage.master.scaler else None
        write_manifest(directory, {
            "kind": "consolidated" if consolidated else "sharded", "stage": stage.name, "world_size": world_size,
            "step": step, "precision": stage.precision.name, "loss_scaler": scaler.state_dict() if scaler else None,
            "wire": str(stage.wire.wire_dtype) if _wire(stage) else None, "save_id": save_id,
            "data": data or {}, "state": stage.full_state_shapes(), "sharded": stage.sharded_names(),
            "files": files, "saved_at": time.strftime("%Y-%m-%dT%H:%M:%S%z")})
    _barrier(comm, "checkpoint manifest written")  # nobody moves on (or loads it) before it is complete
    return directory


def load(stage, path: str | Path) -> dict:
    """Load the checkpoint ``path`` names (a step directory, or a --save directory: its latest) into
    ``stage``, on every rank; no communication.  Returns the manifest, with ``notes`` on what did not carry
    over (error-feedback residuals: only a sharded checkpoint loaded in the same layout keeps them).
    Refuses, naming the file or the tensor, a checkpoint that is incomplete, damaged, of another format
    version, another model or another precision."""
    _require_optimizer(stage)
    directory = find(path)
    manifest = read_manifest(directory)
    _check_fits(manifest, directory, stage.full_state_shapes(), stage.precision.name)
    payloads = [load_file(directory / name) for name in manifest["files"]]
    for name, payload in zip(manifest["files"], payloads):
        if payload.get("save_id") != manifest["save_id"]:
            raise CheckpointError(f"{directory / name}: written by another save than the manifest's (a save into this "
                                  f"directory was interrupted); resume from an earlier checkpoint")
    if manifest["kind"] == "consolidated":
        model = payloads[0]["model"]
        optimizer = _by_name(payloads[0]["optimizer"], payloads[0]["param_names"])
    else:
        model, optimizer = _assemble(stage, manifest, payloads, directory)
    stage.load_full_state_dict(model)
    stage.load_full_optimizer_state_dict(_indexed(optimizer, _optimizer_names(stage), directory))
    if manifest["loss_scaler"] and stage.master and stage.master.scaler:
        stage.master.scaler.load_state_dict(manifest["loss_scaler"])
    wire = _wire(stage)
    same_layout = (manifest["stage"], manifest["world_size"], manifest["wire"]) == (
        stage.name, stage.world_size, str(wire.wire_dtype) if wire else None)
    sharded = manifest["kind"] == "sharded"
    mine = payloads[stage.rank] if same_layout and sharded else payloads[0]
    torch.set_rng_state(mine["rng"]["cpu"])
    if "cuda" in mine["rng"] and torch.cuda.is_available():
        torch.cuda.set_rng_state(mine["rng"]["cuda"])
    notes = []
    if wire and same_layout and sharded:
        device = next(stage.module.parameters()).device
        wire.residuals.update({key: value.to(device) for key, value in mine["residuals"].items()})
    elif wire:  # per-rank state of one layout: it has no meaning in another
        notes.append("error-feedback residuals start again from zero: " + (
            f"they belong to {manifest['stage']}'s buckets on {manifest['world_size']} ranks" if sharded else
            "a consolidated checkpoint holds no rank's own state (save sharded to resume them exactly)"))
    return {**manifest, "directory": str(directory), "notes": notes}


# ---------------------------------------------------------------------- what is checked before loading
def inspect(path: str | Path, shapes: dict | None = None, precision: str | None = None) -> dict:
    """The manifest of the checkpoint ``path`` names, checked as :func:`load` checks it -- complete, ours, and
    (if given) of a model with these ``name -> (shape, dtype)`` and this precision -- without loading it:
    what a launcher runs before it starts any rank.  Adds ``directory``."""
    directory = find(path)
    manifest = read_manifest(directory)
    if shapes is not None:
        _check_fits(manifest, directory, shapes, precision or manifest["precision"])
    return {**manifest, "directory": str(directory)}


def _check_fits(manifest: dict, directory: Path, mine: dict, precision: str) -> None:
    if manifest["precision"] != precision:
        raise CheckpointError(f"{directory}: saved with precision {manifest['precision']}, this run uses "
                              f"{precision}; resume with --precision {manifest['precision']} (a run "
                              f"cannot change precision while resuming)")
    for name in [*mine, *(n for n in manifest["state"] if n not in mine)]:
        theirs, ours = manifest["state"].get(name), mine.get(name)
        if theirs is None or ours is None or tuple(theirs[0]) != tuple(ours[0]) or theirs[1] != ours[1]:
            raise CheckpointError(
                f"{directory}: a checkpoint of another model: '{name}' is {_describe(theirs)} in the checkpoint "
                f"and {_describe(ours)} in this model; resume with the --model it was saved with")


def _describe(entry) -> str:
    return "absent" if entry is None else f"{entry[1].replace('torch.', '')} {list(entry[0])}"


# ---------------------------------------------------------------------- sharded: the whole state from the parts
def _assemble(stage, manifest: dict, payloads: list[dict], directory: Path) -> tuple[dict, dict]:
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


def _rest(stage) -> dict:
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
def _optimizer_names(stage) -> list[list[str]]:
    names = {id(p): n for n, p in stage.module.named_parameters()}
    return [[names[id(p)] for p in group["params"]] for group in stage.optimizer.param_groups]


def _optimizer_groups(stage) -> list[dict]:
    return [{**{k: v for k, v in group.items() if k != "params"}, "params": names}
            for group, names in zip(stage.optimizer.param_groups, _optimizer_names(stage))]


def _by_name(saved: dict, names: list[list[str]]) -> dict:
    """A plain optimizer state_dict (indexed by position) re-keyed by parameter name."""
    flat = [n for group in names for n in group]
    return {"state": {flat[i]: entry for i, entry in saved["state"].items()},
            "param_groups": [{**{k: v for k, v in g.items() if k != "params"}, "params": group}
                             for g, group in zip(saved["param_groups"], names)]}


def _indexed(saved: dict, names: list[list[str]], directory: Path) -> dict:
    """The reverse, in *this* run's parameter order, so it loads whatever order the optimizer was built in."""
    if [sorted(g["params"]) for g in saved["param_groups"]] != [sorted(g) for g in names]:
        raise CheckpointError(f"{directory}: the optimizer's parameter groups differ from this run's "
                              f"({[len(g['params']) for g in saved['param_groups']]} parameters per group saved, "
                              f"{[len(g) for g in names]} here); build the optimizer as the saved run did")
    position = {n: i for i, n in enumerate(n for group in names for n in group)}
    return {"state": {position[n]: entry for n, entry in saved["state"].items()},
            "param_groups": [{**{k: v for k, v in g.items() if k != "params"}, "params": [position[n] for n in group]}
                             for g, group in zip(saved["param_groups"], names)]}


# ---------------------------------------------------------------------- small things
def _require_optimizer(stage) -> None:
    if stage.optimizer is None:
        raise CheckpointError(f"rank {stage.rank}: a checkpoint keeps the optimizer's state, and this stage was wrapped "
                              f"without one; pass your optimizer to make_stage(name, model, optimizer, comm)")


def _wire(stage):
    wire = getattr(stage, "wire", None)
    return wire if wire is not None and wire.error_feedback else None


def _rng_state() -> dict:
    state = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _everyones(comm, value: int) -> list[int]:
    """Every rank's ``value`` (exact in float64 up to 2**53 bytes); the reference has no comm."""
    if comm is None:
        return [value]
    mine = torch.tensor([float(value)], dtype=torch.float64)
    everyone = torch.empty(comm.world_size, dtype=torch.float64)
    comm.all_gather(everyone, mine, tag=Tag("checkpoint file sizes"))
    return [int(v) for v in everyone.tolist()]


def _barrier(comm, what: str) -> None:
    if comm is None:
        return
    comm.all_reduce(torch.zeros(1), tag=Tag(what))

"""Checkpoints for every stage: save at N ranks, load at M, from any stage into any stage.

**Sharded** (the default): each rank writes what it owns -- :meth:`Stage.owned_parts`, ranges of the
*parameters* with their optimizer state -- with no communication beyond an exchange of file sizes and
digests; rank 0 adds the buffers, frozen parameters and optimizer hyper-parameters.  **Consolidated**: the whole model and
optimizer state_dicts gathered (``full_state_dict``), one file a plain PyTorch user loads::

    state = torch.load("step-00000020/consolidated.pt")
    model.load_state_dict(state["model"]); optimizer.load_state_dict(state["optimizer"])

Loading either kind assembles the whole state_dicts a single device would hold and hands them to
:meth:`Stage.load_full_state_dict` and ``load_full_optimizer_state_dict``: each stage keeps what it holds.
That is the whole of resharding -- ZeRO-3 on 4 ranks to ``ddp`` on 3 is the same call as resuming in place
-- at the cost of every rank reading the whole state once (DCP reads only what a rank owns; see
docs/training-runs.md for why minizero writes its own format).  The manifest carries what a resumed run must continue
from exactly: the step, the precision and loss-scaler state, each rank's RNG, the data position.
"""
from __future__ import annotations

import secrets
import shutil
import time
from pathlib import Path

import torch

from ..comm import Tag
from .checks import check_fits, check_optimizer, settings_followed, unverified
from .directory import LATEST, clean, point_latest, publish, staging_dir, step_dir
from .directory import find as find_with_notes
from .files import CONSOLIDATED, CheckpointError, load_file, rank_file, read_manifest, save_tensors, write_manifest
from .whole import assemble, by_name, indexed, optimizer_groups, optimizer_names, rest

__all__ = ["CheckpointError", "save", "load", "inspect", "find", "LATEST"]


def save(stage, root: str | Path, step: int, *, consolidated: bool = False, data: dict | None = None) -> Path:
    """Save ``stage`` (every rank calls this) as checkpoint ``step`` under ``root``; returns its directory.
    ``data``: what the training loop needs to continue (its position, seed, batch size), kept in the manifest.
    Written beside any earlier checkpoint and put in place only when complete (``directory.py``)."""
    _require_optimizer(stage)  # before anything is written
    stage.check_checkpointable(stage.rank)
    comm, rank, world_size = stage.comm, stage.rank, stage.world_size
    root, final = Path(root), step_dir(root, step)
    writes = rank == 0 or not consolidated

    def prepare() -> list[int]:
        if rank == 0:
            root.mkdir(parents=True, exist_ok=True)
            clean(root)  # what killed saves left behind, before this one adds its own
        return [secrets.randbits(52) if rank == 0 else 0]
    save_id = _together(comm, prepare, 1, final, "prepare the directory")[0][0]
    staging = staging_dir(root, step, save_id)
    payload = _payload(stage, consolidated)  # consolidated: gathers, so every rank takes part
    if consolidated:  # one file, but every rank's generators: dropout masks and data orders resume exactly
        payload["rngs"] = _everyones_rng(comm)

    def write_own_file() -> list[int]:
        if not writes:
            return [0] * 17  # (consolidated: rank 0 writes the one file)
        staging.mkdir(parents=True, exist_ok=True)  # every writer: whoever comes first makes it
        return _record(*save_tensors(staging / _file_name(rank, world_size, consolidated),
                                     {**payload, "save_id": save_id, "rng": _rng_state()}))
    records = _together(comm, write_own_file, 17, final, "write their file", staging if writes else None)
    files = ({CONSOLIDATED: _entry(records[0])} if consolidated else
             {rank_file(r, world_size): _entry(v) for r, v in enumerate(records)})

    def write_the_manifest() -> list[int]:
        if rank == 0:
            write_manifest(staging, _manifest(stage, step, consolidated, save_id, data, files))
        return []
    _together(comm, write_the_manifest, 0, final, "write the manifest", staging if writes else None)

    def put_in_place() -> list[int]:  # complete everywhere: only now does it replace anything
        if rank == 0:  # one rank renames: on a shared file system a second could move the new one aside
            publish(staging, final, save_id)
            point_latest(final)
        return []
    _together(comm, put_in_place, 0, final, "put it in place",  # nobody moves on (or loads it) before it is
              stands="rank 0's error says which checkpoint the directory now resolves to")
    return final


def _together(comm, action, width: int, final: Path, what: str, staging: Path | None = None,
              stands: str = "the previous checkpoint stands") -> list[list[int]]:
    """``action()`` on every rank, then every rank's result (``width`` ints) -- or, if it failed anywhere,
    the failure on every rank at once (no rank waits for a peer that will never come), with this save's
    ``staging`` directory removed: nothing of it is left behind.  ``stands``: what the others are told stands."""
    failure, values = None, [0] * width
    try:
        values = action()
    except Exception as error:  # noqa: BLE001 -- the others must hear of it, not wait for it
        failure = error
    everyone = _everyones(comm, [0 if failure else 1, *values])
    failed = [r for r, row in enumerate(everyone) if row[0] == 0]
    if failed and staging is not None:
        shutil.rmtree(staging, ignore_errors=True)
    if failure is not None:
        raise failure
    if failed:
        raise CheckpointError(f"{final}: rank(s) {failed} could not {what}, so this save was not completed; "
                              f"{stands}")
    return [row[1:] for row in everyone]


def _payload(stage, consolidated: bool) -> dict:
    if consolidated:
        return {"model": stage.full_state_dict(), "optimizer": stage.full_optimizer_state_dict(),
                "param_names": optimizer_names(stage)}
    payload = {"parts": [(p.name, p.start, p.stop, p.value, p.state) for p in stage.owned_parts()],
               "wire": stage.wire.state_dict() if _wire(stage) else {"residuals": {}}}
    if stage.rank == 0:
        payload["rest"] = rest(stage)
        payload["optimizer_groups"] = optimizer_groups(stage)
    return payload


def _manifest(stage, step: int, consolidated: bool, save_id: int, data, files: dict) -> dict:
    scaler = stage.master.scaler if stage.master and stage.master.scaler else None
    return {"kind": "consolidated" if consolidated else "sharded", "stage": stage.name,
            "world_size": stage.world_size, "step": step, "precision": stage.precision.name,
            "loss_scaler": scaler.state_dict() if scaler else None,
            "wire": str(stage.wire.wire_dtype) if _wire(stage) else None, "save_id": save_id,
            "optimizer": {"class": _optimizer_class(stage).__name__}, "data": data or {},
            "state": stage.full_state_shapes(), "sharded": stage.sharded_names(), "files": files,
            "saved_at": time.strftime("%Y-%m-%dT%H:%M:%S%z")}


def _file_name(rank: int, world_size: int, consolidated: bool) -> str:
    return CONSOLIDATED if consolidated else rank_file(rank, world_size)


def _record(size: int, sha256: str) -> list[int]:
    """A file's size and SHA-256 as 17 numbers a float64 all-gather carries exactly (16-bit words)."""
    return [size] + [int(sha256[i:i + 4], 16) for i in range(0, 64, 4)]


def _entry(record: list[int]) -> list:
    return [record[0], "".join(f"{w:04x}" for w in record[1:])]


def find(path: str | Path) -> Path:
    """The checkpoint directory ``path`` names (``directory.find`` without its notes)."""
    return find_with_notes(path)[0]


def load(stage, path: str | Path) -> dict:
    """Load the checkpoint ``path`` names (a step directory, or a --save directory: its latest) into
    ``stage``, on every rank; no communication.  Returns the manifest, with ``notes`` on which checkpoint was
    taken and what was skipped, which settings the checkpoint's replaced, and what did not carry over
    (error-feedback residuals: only a sharded checkpoint loaded in the same layout keeps them).  Refuses, naming
    the file, the field or the tensor, a checkpoint that is incomplete, damaged (each file's SHA-256 is checked),
    of another format version, another model, another precision or another optimizer."""
    _require_optimizer(stage)
    directory, notes = find_with_notes(path)
    manifest = read_manifest(directory)
    notes += unverified(manifest)
    check_fits(manifest, directory, stage.full_state_shapes(), stage.precision.name)
    check_optimizer(manifest, directory, _optimizer_class(stage))
    payloads = [load_file(directory / name) for name in manifest["files"]]  # each verified by its SHA-256...
    for (name, (_, sha256)), payload in zip(manifest["files"].items(), payloads, strict=True):
        if sha256 is None and payload.get("save_id") != manifest["save_id"]:  # ...except format 1's: its save id
            raise CheckpointError(f"{directory / name}: written by another save than the manifest's (copied in "
                                  f"from another checkpoint); resume from an earlier checkpoint")
    if manifest["kind"] == "consolidated":
        model = payloads[0]["model"]
        optimizer = by_name(payloads[0]["optimizer"], payloads[0]["param_names"])
    else:
        model, optimizer = assemble(stage, manifest, payloads, directory)
    in_this_order = indexed(optimizer, optimizer_names(stage), directory)
    notes += settings_followed(stage, optimizer)
    stage.load_full_state_dict(model)
    stage.load_full_optimizer_state_dict(in_this_order)
    if manifest["loss_scaler"] and stage.master and stage.master.scaler:
        stage.master.scaler.load_state_dict(manifest["loss_scaler"])
    wire = _wire(stage)
    same_layout = (manifest["stage"], manifest["world_size"], manifest["wire"]) == (
        stage.name, stage.world_size, str(wire.wire_dtype) if wire else None)
    sharded = manifest["kind"] == "sharded"
    mine = payloads[stage.rank] if same_layout and sharded else payloads[0]
    _set_rng_state(_generators_of(stage, manifest, payloads, notes))
    if wire and same_layout and sharded:
        # (a checkpoint saved before the wires kept more than residuals has "residuals" alone)
        wire.load_state_dict(mine.get("wire") or {"residuals": mine["residuals"]}, next(stage.module.parameters()).device)
    elif wire:  # per-rank state of one layout: it has no meaning in another
        notes.append("the wire's state (error-feedback residuals; a stochastic codec's counts; PowerSGD's Q) starts again: " + (
            f"they belong to {manifest['stage']}'s buckets on {manifest['world_size']} ranks" if sharded else
            "a consolidated checkpoint holds no rank's own state (save sharded to resume them exactly)"))
    return {**manifest, "directory": str(directory), "notes": notes}


# ---------------------------------------------------------------------- what is checked before loading
def inspect(path: str | Path, shapes: dict | None = None, precision: str | None = None,
            optimizer: type | None = None) -> dict:
    """The manifest of the checkpoint ``path`` names, checked as :func:`load` checks it -- complete, whole
    (every file's SHA-256), ours, and (if given) of a model with these ``name -> (shape, dtype)``, this precision
    and this optimizer class -- without loading it: what a launcher runs before it starts any rank.  Adds
    ``directory`` and ``notes`` (which checkpoint a --save directory resolved to, what was skipped)."""
    directory, notes = find_with_notes(path)
    manifest = read_manifest(directory)
    if shapes is not None:
        check_fits(manifest, directory, shapes, precision or manifest["precision"])
    if optimizer is not None:
        check_optimizer(manifest, directory, optimizer)
    return {**manifest, "directory": str(directory), "notes": notes + unverified(manifest)}


# ---------------------------------------------------------------------- small things
def _require_optimizer(stage) -> None:
    if stage.optimizer is None:
        raise CheckpointError(f"rank {stage.rank}: a checkpoint keeps the optimizer's state, and this stage was wrapped "
                              f"without one; pass your optimizer to make_stage(name, model, optimizer, comm)")


def _optimizer_class(stage) -> type:
    """The user's optimizer class: ZeRO's ShardedOptimizer runs one of it over this rank's pieces."""
    return getattr(stage.optimizer, "optimizer_class", type(stage.optimizer))


def _wire(stage):
    """The stage's wire, if what it kept between steps decides the next ones (``keeps_state``): saved, and loaded
    in the same layout."""
    wire = getattr(stage, "wire", None)
    return wire if wire is not None and wire.keeps_state else None


def _generators_of(stage, manifest: dict, payloads: list[dict], notes: list[str]) -> dict:
    """This rank's random generators as saved -- by the same rank of a run at the same N, whatever its stage --
    or, at another N, rank 0's (each rank's stream has no owner then), said."""
    if manifest["world_size"] == stage.world_size:
        if manifest["kind"] == "sharded":
            return payloads[stage.rank]["rng"]
        if "rngs" in payloads[0]:  # (format 1 kept rank 0's only)
            return payloads[0]["rngs"][stage.rank]
    notes.append(f"every rank's random generators start from rank 0's: the checkpoint was saved by "
                 f"{manifest['world_size']} rank(s)" + ("" if manifest["world_size"] != stage.world_size else
                                                        ", in a format that kept rank 0's only"))
    return payloads[0]["rng"]


def _set_rng_state(saved: dict) -> None:
    torch.set_rng_state(saved["cpu"])
    if "cuda" in saved and torch.cuda.is_available():
        torch.cuda.set_rng_state(saved["cuda"])


def _everyones_rng(comm) -> list[dict]:
    """Every rank's random generators (a few KB each), for the one file a consolidated save writes."""
    mine = _rng_state()
    keys = sorted(mine)
    sizes = [mine[k].numel() for k in keys]
    rows = _everyones(comm, torch.cat([mine[k] for k in keys]).tolist())
    return [dict(zip(keys, torch.tensor(row, dtype=torch.uint8).split(sizes), strict=True)) for row in rows]


def _rng_state() -> dict:
    state = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _everyones(comm, values: list[int]) -> list[list[int]]:
    """Every rank's ``values`` (each exact in float64 up to 2**53); the reference has no comm."""
    if comm is None:
        return [values]
    mine = torch.tensor([float(v) for v in values], dtype=torch.float64)
    everyone = torch.empty(comm.world_size * len(values), dtype=torch.float64)
    comm.all_gather(everyone, mine, tag=Tag("checkpoint file sizes and digests"))
    return [[int(v) for v in row] for row in everyone.view(comm.world_size, len(values)).tolist()]

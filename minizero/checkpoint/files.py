"""A checkpoint on disk: one directory per save, files written atomically, the manifest last.

::

    SAVE_DIR/
      latest                          "step-00000020": the newest complete checkpoint
      step-00000020/
        manifest.json                 written last: without it the directory is not a checkpoint
        rank-00000-of-00004.pt ...    sharded: what each rank owns (minizero.parts)
        consolidated.pt               consolidated: {"model": ..., "optimizer": ...}, torch.load-able

Every file is written under a temporary name, flushed to disk and renamed (``os.replace`` is atomic on
POSIX), and the manifest -- which lists every file with its size -- is renamed into place only after every
rank's file is.  So a save that crashes at any point leaves a directory that is refused, naming what is
missing, and ``latest`` still names the previous checkpoint, which loads.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import torch

FORMAT = "minizero-checkpoint"
FORMAT_VERSION = 1
MANIFEST = "manifest.json"
LATEST = "latest"
CONSOLIDATED = "consolidated.pt"


class CheckpointError(ValueError):
    """A checkpoint that cannot be loaded into this run: the message says which file and what to do."""


def rank_file(rank: int, world_size: int) -> str:
    return f"rank-{rank:05d}-of-{world_size:05d}.pt"


def step_dir(root: str | Path, step: int) -> Path:
    return Path(root) / f"step-{step:08d}"


def write_atomic(path: Path, write) -> int:
    """``write(file)`` into a temporary name beside ``path``, fsync, rename; returns the bytes written."""
    temporary = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with open(temporary, "wb") as f:
        write(f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(temporary, path)
    directory = os.open(path.parent, os.O_RDONLY)  # the rename itself reaches the disk, in order
    try:
        os.fsync(directory)
    finally:
        os.close(directory)
    return path.stat().st_size


def save_tensors(path: Path, payload) -> int:
    return write_atomic(path, lambda f: torch.save(payload, f))


def save_text(path: Path, text: str) -> int:
    return write_atomic(path, lambda f: f.write(text.encode()))


def find(path: str | Path) -> Path:
    """The checkpoint directory ``path`` names: itself if it holds a manifest, else the one its ``latest``
    names, else its newest ``step-*`` directory that holds a manifest."""
    path = Path(path)
    if not path.is_dir():
        raise CheckpointError(f"{path}: no such checkpoint directory; pass the --save directory of a run, or "
                              f"one of its step-* directories")
    if (path / MANIFEST).exists() or path.name.startswith("step-"):  # read_manifest refuses one without
        return path
    if (path / LATEST).exists() and (path / (path / LATEST).read_text().strip() / MANIFEST).exists():
        return path / (path / LATEST).read_text().strip()
    complete = sorted(d for d in path.glob("step-*") if (d / MANIFEST).exists())  # latest's save was interrupted
    if complete:
        return complete[-1]
    started = sorted(path.glob("step-*"))
    if started:
        raise CheckpointError(f"{started[-1]}: no {MANIFEST}, so the save did not finish (the run stopped while "
                              f"saving); there is no earlier complete checkpoint in {path} to resume from")
    raise CheckpointError(f"{path} holds no checkpoint (no {MANIFEST}, no step-* directories)")


def read_manifest(directory: Path) -> dict:
    """The manifest, after checking that it is ours, of a version we read, and that every file it lists is
    there at its full size (a truncated copy is refused here, naming the file)."""
    path = directory / MANIFEST
    if not path.exists():
        raise CheckpointError(f"{directory}: no {MANIFEST}, so this save did not finish (the run stopped while "
                              f"saving); resume from the directory's parent, whose '{LATEST}' names the last "
                              f"complete checkpoint")
    try:
        manifest = json.loads(path.read_text())
    except json.JSONDecodeError as error:
        raise CheckpointError(f"{path}: not valid JSON ({error}); the file is damaged -- resume from an earlier "
                              f"checkpoint") from None
    if manifest.get("format") != FORMAT:
        raise CheckpointError(f"{path}: not a minizero checkpoint manifest (format {manifest.get('format')!r})")
    if manifest.get("format_version") != FORMAT_VERSION:
        raise CheckpointError(f"{path}: written in checkpoint format version {manifest.get('format_version')}; this "
                              f"minizero reads version {FORMAT_VERSION}. Load it with the minizero that wrote it and "
                              f"save it consolidated, or start a new run")
    for name, size in manifest["files"].items():
        file = directory / name
        if not file.exists():
            raise CheckpointError(f"{file}: missing, but the manifest lists it; copy the whole checkpoint directory")
        if file.stat().st_size != size:
            raise CheckpointError(f"{file}: {file.stat().st_size} bytes, but the manifest says {size}: the file is "
                                  f"truncated or was overwritten; resume from an earlier checkpoint")
    return manifest


def load_file(path: Path) -> dict:
    """``torch.load`` one file of a checkpoint (memory-mapped: a rank reads the pages it uses)."""
    try:
        return torch.load(path, map_location="cpu", mmap=True, weights_only=False)
    except Exception as error:  # noqa: BLE001 -- any failure to read is the same news for the user
        raise CheckpointError(f"{path}: cannot be read ({type(error).__name__}: {error}); the file is damaged -- "
                              f"resume from an earlier checkpoint") from None


def write_manifest(directory: Path, manifest: dict) -> None:
    """The manifest, then ``latest``: each renamed into place, so each is whole or absent."""
    save_text(directory / MANIFEST, json.dumps({"format": FORMAT, "format_version": FORMAT_VERSION, **manifest},
                                               indent=1))
    save_text(directory.parent / LATEST, directory.name)

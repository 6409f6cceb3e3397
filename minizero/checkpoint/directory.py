"""A run's checkpoints on disk, and how a new one takes its place without ever destroying the last complete one.

::

    SAVE_DIR/
      latest                               "step-00000020": always a complete checkpoint
      step-00000010/  step-00000020/       complete checkpoints (files.py: a manifest and its files)
      .step-00000030.saving-3f2a.../       a save in progress (or one that was killed): never loaded

A save writes every file, and the manifest last, into a *staging* directory of its own; only when it is complete
does it become ``step-N``.  If ``step-N`` already exists (a run resumed from an earlier step saves step N again)
the old one is first renamed aside, the staged one renamed in, ``latest`` moved, and the old one deleted: each
step one atomic ``rename``.  A save killed or out of disk at any moment therefore leaves the old ``step-N``
whole -- under its name, or (killed between the two renames) under its aside name beside a complete new one --
and :func:`find` resolves ``latest`` to a complete checkpoint in every case.  What a killed save leaves behind
(staging directories, temporary files) is removed by the next save, and :func:`find` reports what it skipped.

Rank 0 renames, after every rank's file and the manifest are complete; so a sharded checkpoint on several nodes
needs a file system they all share (loading reads every rank's file on every rank anyway).
"""
from __future__ import annotations

import os
import re
import shutil
from pathlib import Path

from .files import MANIFEST, TEMPORARY, CheckpointError, CouldNotWrite, fsync_directory, write_atomic

LATEST = "latest"
_HIDDEN = re.compile(r"^\.(step-\d{8})\.(saving|replaced)-([0-9a-f]+)$")


def step_dir(root: str | Path, step: int) -> Path:
    return Path(root) / f"step-{step:08d}"


def staging_dir(root: str | Path, step: int, save_id: int) -> Path:
    return Path(root) / f".step-{step:08d}.saving-{save_id:x}"


def _aside(final: Path, save_id: int) -> Path:
    return final.with_name(f".{final.name}.replaced-{save_id:x}")


def publish(staging: Path, final: Path, save_id: int) -> None:
    """Make the complete ``staging`` directory ``final``, keeping an old ``final`` until the new one is in."""
    aside = _aside(final, save_id)
    try:
        if final.exists():
            os.replace(final, aside)
        os.replace(staging, final)
    except OSError as error:
        raise CheckpointError(f"{final}: the complete save could not be renamed into place: {error.strerror or error};"
                              f" --resume {final.parent} takes the newest complete checkpoint, and the next save "
                              f"removes what this one left") from None
    try:
        fsync_directory(final.parent)
    except OSError as error:
        raise CheckpointError(f"{final}: complete and in place, but the rename could not be flushed to disk "
                              f"({error.strerror or error}): a power cut now could undo it") from None
    shutil.rmtree(aside, ignore_errors=True)


def point_latest(final: Path) -> None:
    try:
        write_atomic(final.parent / LATEST, lambda f: f.write(final.name.encode()))
    except CouldNotWrite as error:  # the save itself is in place: say so, not "the previous one stands"
        raise CheckpointError(f"{final}: complete and in place, but '{LATEST}' could not be moved to it "
                              f"({error.reason}); resume with --resume {final}") from None


def clean(root: Path, keep: Path | None = None) -> list[str]:
    """Remove what killed saves left under ``root`` (not ``keep``, this save's own staging directory); first
    finish a publish that was killed between its two renames.  Returns what was removed, for the record."""
    removed = []
    for path in sorted(root.glob(".step-*")):
        match = _HIDDEN.match(path.name)
        if not match or path == keep:
            continue
        final = root / match.group(1)
        if match.group(2) == "saving" and (path / MANIFEST).exists() and not final.exists():
            os.replace(path, final)  # a complete save whose publish was cut short: it is the newer one
            continue
        shutil.rmtree(path, ignore_errors=True)
        removed.append(path.name)
    for leftover in [*root.glob(f".*{TEMPORARY}*"), *root.glob(f"step-*/*{TEMPORARY}*")]:  # latest's, old saves
        leftover.unlink(missing_ok=True)
        removed.append(str(leftover.relative_to(root)))
    return removed


def find(path: str | Path) -> tuple[Path, list[str]]:
    """The checkpoint directory ``path`` names, and notes on what was skipped to reach it: ``path`` itself if
    it is a ``step-*`` directory (read_manifest refuses it if incomplete), else the one its ``latest`` names,
    else its newest complete ``step-*`` directory."""
    path = Path(path)
    if not path.is_dir():
        for staged in sorted(path.parent.glob(f".{path.name}.saving-*")) if path.name.startswith("step-") else []:
            if (staged / MANIFEST).exists():  # killed between a publish's two renames: the new one is whole
                return staged, [f"took {path.name} from {staged.name}: its save was complete, the rename into "
                                f"place was cut short (the next save finishes it)"]
        raise CheckpointError(f"{path}: no such checkpoint directory; pass the --save directory of a run, or "
                              f"one of its step-* directories")
    if (path / MANIFEST).exists():
        return path, []
    if path.name.startswith("step-"):
        newest = _complete(path.parent)
        hint = f"; the newest complete checkpoint there is {newest[-1]}" if newest else ""
        raise CheckpointError(f"{path}: no {MANIFEST}, so this save did not finish (the run stopped while saving)"
                              f"{hint}")
    skipped = [f"skipped {d.name}: a save that did not finish (the run stopped while saving it)"
               for d in sorted(path.glob(".step-*.saving-*")) if not (d / MANIFEST).exists()]
    named = (path / LATEST).read_text().strip() if (path / LATEST).is_file() else None
    if named and (path / named / MANIFEST).exists():
        return path / named, skipped + [f"took {named}, which '{LATEST}' names"]
    if named:  # killed between a publish's two renames: the new save is complete under its staging name
        for staged in sorted(path.glob(f".{named}.saving-*")):
            if (staged / MANIFEST).exists():
                return staged, [f"took {named} from {staged.name}: its save was complete, the rename into place "
                                f"was cut short (the next save finishes it)"]
    complete = _complete(path)
    if complete:
        note = f"'{LATEST}' names {named}, which is not complete; " if named else ""
        return complete[-1], skipped + [f"{note}took {complete[-1].name}, the newest complete checkpoint"]
    if skipped or list(path.glob("step-*")):
        raise CheckpointError(f"{path}: no complete checkpoint (every save into it was stopped before it finished);"
                              f" start a new run")
    raise CheckpointError(f"{path} holds no checkpoint (no {MANIFEST}, no step-* directories)")


def _complete(root: Path) -> list[Path]:
    return sorted(d for d in root.glob("step-*") if (d / MANIFEST).exists())

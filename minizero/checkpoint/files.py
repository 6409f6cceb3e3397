"""One checkpoint's files: each written atomically with its SHA-256, the manifest that lists them, and the
checks that refuse a file or a manifest that is not what was written.

::

    step-00000020/
      manifest.json                 written last: every file's size and SHA-256, and its own SHA-256
      rank-00000-of-00004.pt ...    sharded: what each rank owns (minizero.parts.part)
      consolidated.pt               consolidated: {"model": ..., "optimizer": ...}, torch.load-able

Every file is written under a temporary name, flushed to disk and renamed (``os.replace`` is atomic on POSIX),
hashed as it is written.  Why a hash and not only the size: ``torch.load(mmap=True)`` does not check the zip
archive's CRCs, so a file damaged in place (a disk, a copy, an editor) loads without a word -- 16 float32 zeros
in a rank's file resumed a run 0.46 away from where it stopped.  The manifest hashes itself too, so an edited
step or precision is refused like a damaged tensor.  Where a save's directory goes, and how it replaces an old
one without ever destroying it, is ``directory.py``'s business.
"""
from __future__ import annotations

import errno
import hashlib
import json
import os
from pathlib import Path

import torch

FORMAT = "minizero-checkpoint"
FORMAT_VERSION = 2  # 2: files and the manifest carry SHA-256 digests; the optimizer's class is recorded
MANIFEST = "manifest.json"
CONSOLIDATED = "consolidated.pt"
TEMPORARY = ".tmp-"  # in the name of a file being written: what a killed save leaves behind
#: What every manifest holds, with its type: a field missing or of another type is named, never a KeyError.
FIELDS = {"kind": str, "stage": str, "world_size": int, "step": int, "precision": str, "save_id": int,
          "data": dict, "state": dict, "sharded": list, "files": dict, "optimizer": dict}


class CheckpointError(ValueError):
    """A checkpoint that cannot be saved or loaded here: the message says which file and what to do."""


class CouldNotWrite(CheckpointError):
    """A file of a save that could not be written (``reason``: the OS's words): nothing of the save is in place."""

    def __init__(self, path: Path, reason: str):
        super().__init__(f"{path}: could not be written: {reason}; the previous checkpoint stands")
        self.reason = reason


def rank_file(rank: int, world_size: int) -> str:
    return f"rank-{rank:05d}-of-{world_size:05d}.pt"


class _Hashing:
    """A file object that hashes what passes through it (``torch.save`` writes through it), and keeps the
    ``OSError`` a write raised: torch's zip writer rewords it as "enforce fail ... unexpected pos"."""

    def __init__(self, f):
        self.f, self.digest, self.error = f, hashlib.sha256(), None

    def write(self, data) -> int:
        self.digest.update(data)
        try:
            return self.f.write(data)
        except OSError as error:
            self.error = error
            raise

    def __getattr__(self, name):  # flush, tell, seek: torch.save's zip writer asks for them
        return getattr(self.f, name)


def write_atomic(path: Path, write) -> tuple[int, str]:
    """``write(file)`` into a temporary name beside ``path``, fsync, rename; returns (bytes, SHA-256 hex).
    A failure (disk full, read-only) removes the temporary file and says which file could not be written."""
    temporary, hashing = path.with_name(f".{path.name}{TEMPORARY}{os.getpid()}"), None
    try:
        with open(temporary, "wb") as f:
            hashing = _Hashing(f)
            write(hashing)
            f.flush()
            os.fsync(f.fileno())
        os.replace(temporary, path)
        fsync_directory(path.parent)  # the rename itself reaches the disk, in order
    except (OSError, RuntimeError) as error:
        temporary.unlink(missing_ok=True)
        cause = hashing.error if hashing is not None and hashing.error is not None else error
        if not isinstance(cause, OSError):
            raise
        full = " (the disk is full: free space, or save elsewhere)" if cause.errno == errno.ENOSPC else ""
        raise CouldNotWrite(path, f"{cause.strerror or cause}{full}") from None
    return path.stat().st_size, hashing.digest.hexdigest()


def fsync_directory(directory: Path) -> None:
    handle = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(handle)
    finally:
        os.close(handle)


def save_tensors(path: Path, payload) -> tuple[int, str]:
    return write_atomic(path, lambda f: torch.save(payload, f))


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


# ---------------------------------------------------------------------- the manifest
def _canonical(manifest: dict) -> bytes:
    """The bytes the manifest's own digest covers: everything but the digest, keys sorted."""
    return json.dumps({k: v for k, v in manifest.items() if k != "sha256"}, sort_keys=True).encode()


def write_manifest(directory: Path, manifest: dict) -> None:
    manifest = {"format": FORMAT, "format_version": FORMAT_VERSION, **manifest}
    manifest["sha256"] = hashlib.sha256(_canonical(manifest)).hexdigest()
    write_atomic(directory / MANIFEST, lambda f: f.write(json.dumps(manifest, indent=1).encode()))


def read_manifest(directory: Path, verify: bool = True) -> dict:
    """The manifest, after checking that it is ours, of our version, whole (every field, its own digest, the
    step its directory is named for) and that every file it lists is there at its full size -- and, with
    ``verify``, has its SHA-256 (this reads every file once)."""
    path = directory / MANIFEST
    if not path.exists():
        raise CheckpointError(f"{directory}: no {MANIFEST}, so this save did not finish (the run stopped while "
                              f"saving); resume from the directory above it, which takes the newest complete one")
    try:
        manifest = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise CheckpointError(f"{path}: not valid JSON ({error}); the file is damaged -- resume from an earlier "
                              f"checkpoint") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        found = manifest.get("format") if isinstance(manifest, dict) else type(manifest).__name__
        raise CheckpointError(f"{path}: not a minizero checkpoint manifest (format {found!r})")
    if manifest.get("format_version") == 1:
        return _version_1(manifest, path, directory)
    if manifest.get("format_version") != FORMAT_VERSION:
        raise CheckpointError(f"{path}: written in checkpoint format version {manifest.get('format_version')}; this "
                              f"minizero reads versions 1 and {FORMAT_VERSION}. Load it with the minizero that wrote "
                              f"it, or start a new run")
    _check_fields(manifest, path, FIELDS)
    if manifest.get("sha256") != hashlib.sha256(_canonical(manifest)).hexdigest():
        raise CheckpointError(f"{path}: its contents do not match its SHA-256 (it was edited or damaged after the "
                              f"save); resume from an earlier checkpoint")
    if directory.name.startswith("step-") and directory.name != f"step-{manifest['step']:08d}":
        raise CheckpointError(f"{path}: says step {manifest['step']}, but its directory is {directory.name}; "
                              f"resume from an earlier checkpoint")
    for name, (size, sha256) in manifest["files"].items():
        file = directory / name
        if not file.exists():
            raise CheckpointError(f"{file}: missing, but the manifest lists it; copy the whole checkpoint directory")
        if file.stat().st_size != size:
            raise CheckpointError(f"{file}: {file.stat().st_size} bytes, but the manifest says {size}: the file is "
                                  f"truncated or was overwritten; resume from an earlier checkpoint")
        if verify and sha256_of(file) != sha256:
            raise CheckpointError(f"{file}: {_why_different(file, manifest['save_id'])}; resume from an earlier "
                                  f"checkpoint")
    return manifest


def _check_fields(manifest: dict, path: Path, fields: dict) -> None:
    for field, kind in fields.items():
        if not isinstance(manifest.get(field), kind):
            what = "missing" if field not in manifest else f"a {type(manifest[field]).__name__}, not a {kind.__name__}"
            raise CheckpointError(f"{path}: field '{field}' is {what}; the manifest is damaged -- resume from an "
                                  f"earlier checkpoint")


def _why_different(file: Path, save_id: int) -> str:
    """A file whose digest is not the manifest's: another save's (each carries its save's id), or damaged."""
    try:
        theirs = torch.load(file, map_location="cpu", mmap=True, weights_only=True).get("save_id")  # untrusted
    except Exception:  # noqa: BLE001 -- unreadable is damaged
        theirs = None
    if theirs is not None and theirs != save_id:
        return "written by another save than the manifest's (copied in from another checkpoint)"
    return "its SHA-256 differs from the manifest's: the file was damaged or replaced after the save"


def _version_1(manifest: dict, path: Path, directory: Path) -> dict:
    """A checkpoint of the first format (sizes, no digests, no optimizer class) still loads -- a user's run is
    not lost to an upgrade -- with what could not be verified said (``load`` then checks each file's save id)."""
    _check_fields(manifest, path, {k: v for k, v in FIELDS.items() if k != "optimizer"})
    for name, size in manifest["files"].items():
        if not (directory / name).exists() or (directory / name).stat().st_size != size:
            raise CheckpointError(f"{directory / name}: missing or not {size} bytes, as the manifest says; the "
                                  f"checkpoint is incomplete -- resume from an earlier one")
    return {**manifest, "files": {n: [size, None] for n, size in manifest["files"].items()}, "optimizer": {},
            "unverified": "written in format version 1, before files carried digests: sizes checked, contents not"}


def load_file(path: Path) -> dict:
    """``torch.load`` one file of a checkpoint whose digest :func:`read_manifest` verified."""
    try:
        return torch.load(path, map_location="cpu", mmap=True, weights_only=False)
    except Exception as error:  # noqa: BLE001 -- any failure to read is the same news for the user
        raise CheckpointError(f"{path}: cannot be read ({type(error).__name__}: {error}); the file is damaged -- "
                              f"resume from an earlier checkpoint") from None

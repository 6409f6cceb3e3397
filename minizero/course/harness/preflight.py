"""What ``train``, ``compare`` and ``soak`` check before any rank starts or any step trains.

A bad option found on the ranks costs a launch and ends in a traceback; a bad output path found after the last
step costs the whole run.  Everything that can be decided from the command line and the file system is decided
here, in the command line's words (the flag, the value, the fix), and refused with a ``ValueError`` (exit 2).
"""
from __future__ import annotations

import argparse
import os
import tempfile
from pathlib import Path

import torch

from ...stages.options import natural_int, positive_float
from .step_memory import gpu_bytes

#: A collective that waits less than this for a peer is no evidence of a stall: a healthy peer may still be
#: building its model or wrapping the stage (the first collectives), or be paused by a busy machine.
MIN_TIMEOUT_S = 1.0
#: The largest seed: step s's batch is drawn from ``manual_seed(seed * 1_000_003 + s)`` (minizero.course.harness.tasks),
#: which must fit torch's 64 bits (unsigned) for any step: 2**44 * 1_000_003 leaves room for 8e17 steps.
MAX_SEED = 2**44 - 1
#: Adam's and AdamW's first bias correction: step 1 moves by lr / (1 - beta1) = 10 lr (beta1 = 0.9).
ADAM_FIRST_STEP = {"adam": 10.0, "adamw": 10.0}


def timeout_s(text: str) -> float:
    """``--timeout``: a number of seconds, at least :data:`MIN_TIMEOUT_S`."""
    value = positive_float(text)
    if value < MIN_TIMEOUT_S:
        raise argparse.ArgumentTypeError(
            f"{text} s is too short to mean a stall (a healthy peer may take that long to reach a collective while "
            f"it builds its model or the machine is busy); use {MIN_TIMEOUT_S:g} s or more (default 300)")
    return value


def seed(text: str) -> int:
    """``--seed``: a whole number from 0 to :data:`MAX_SEED`."""
    value = natural_int(text)
    if value > MAX_SEED:
        raise argparse.ArgumentTypeError(
            f"{value} is beyond {MAX_SEED} (2**44 - 1), the largest seed: step s draws its batch with "
            f"torch.Generator().manual_seed(seed * 1000003 + s), which must fit torch's 64 bits; use a smaller seed")
    return value


def gpu(text: str) -> float:
    """``--gpu``: a memory size (:func:`~minizero.course.harness.step_memory.gpu_bytes`), its refusal word for word
    -- argparse shows only an ``ArgumentTypeError``'s own words (a ``ValueError`` becomes "invalid value")."""
    try:
        return gpu_bytes(text)
    except ValueError as refused:
        raise argparse.ArgumentTypeError(str(refused)) from None


def check_lr(lr: float, optimizer: str, dtype: torch.dtype = torch.float32) -> None:
    """The largest step the optimizer would take must be a number in the masters' dtype: torch refuses to form
    Adam's first step ``lr / (1 - beta1)`` beyond float32's range ("value cannot be converted ... overflow")."""
    factor = ADAM_FIRST_STEP.get(optimizer, 1.0)
    largest = torch.finfo(dtype).max
    if lr * factor > largest:
        step = f"{optimizer}'s first step is lr / (1 - beta1) = {factor:g} x lr" if factor != 1 else "the step is lr x grad"
        raise ValueError(f"--lr {lr:g}: {step} = {lr * factor:.3g}, beyond the largest {str(dtype)[6:]} "
                         f"({largest:.3g}); use --lr {largest / factor:.2g} or less")


def check_design_options(world_size: int, steps: int, given: dict, stages: dict | None = None,
                         chosen: list[str] | None = None, precision=None) -> None:
    """The stage options given on the command line (by keyword), against each other, the precision, the world size
    and the steps, before any rank starts: each ``chosen`` stage (default: every stage) says what it would refuse
    on every rank (``Stage.check_combination``: a wire its collective cannot carry, say) or silently ignore
    (``Stage.check_command_line``).  (Each option is parsed by its declaration, and an option no chosen stage
    takes is refused by the command itself.)"""
    from ...stages import STAGES
    from ...stages.options import constructor_keywords
    registry = stages or STAGES
    for cls in dict.fromkeys(registry[name] for name in (chosen or registry) if name in registry):  # (an unknown
        # name is the command's to refuse, with the list of names)
        if not hasattr(cls, "check_command_line"):  # torch's oracles
            continue
        own = {k: v for k, v in given.items() if k in cls.option_names()}
        if precision is not None and "precision" in cls.option_names():
            own["precision"] = precision
        cls.check_combination(**constructor_keywords(cls, own))
        if set(given) & set(cls.option_names()):
            cls.check_command_line(world_size, steps, given)


def _writable(flag: str, path: str, directory: Path) -> None:
    try:
        with tempfile.TemporaryFile(dir=directory):
            pass
    except OSError as error:
        raise ValueError(f"{flag} {path}: cannot write in {directory} ({error.strerror}); choose a directory you "
                         f"can write to") from None


def check_output_dir(flag: str, path: str) -> None:
    """A directory the run will create or write checkpoints into: not a file, and writable -- checked by writing
    (permission bits lie both ways: root ignores them, an immutable or read-only mount ignores them for root)."""
    target = Path(path)
    if target.exists() and not target.is_dir():
        raise ValueError(f"{flag} {path} is a file, not a directory: checkpoints go into a directory (a step-N "
                         f"directory per save); name a new or existing directory")
    existing = target
    while not existing.exists():
        existing = existing.parent
    if not existing.is_dir():
        raise ValueError(f"{flag} {path}: {existing} is a file, so the directory cannot be made; name another one")
    _writable(flag, path, existing)


def check_plot(path: str) -> None:
    """``--plot FILE``: its directory exists and is writable, and matplotlib can write that format."""
    target = Path(path)
    if target.is_dir():
        raise ValueError(f"--plot {path} is a directory; name a file, e.g. {os.path.join(path, 'loss.png')}")
    parent = target.parent
    if not parent.is_dir():
        raise ValueError(f"--plot {path}: the directory {parent} does not exist; create it, or name a file in an "
                         f"existing directory")
    try:
        from matplotlib.backend_bases import FigureCanvasBase
    except ImportError:
        raise ValueError("--plot needs matplotlib: pip install matplotlib") from None
    formats = FigureCanvasBase.get_supported_filetypes()
    suffix = target.suffix.lstrip(".").lower()
    if suffix not in formats:
        raise ValueError(f"--plot {path}: matplotlib cannot write {'.' + suffix if suffix else 'a file without a suffix'}; "
                         f"name a .png (or one of .{', .'.join(sorted(formats))})")
    _writable("--plot", path, parent)

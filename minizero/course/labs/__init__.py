"""Labs: the learner writes each stage's idea, and the package's own properties judge it.

One lab per lesson (:data:`LABS`): a skeleton file with the machinery given and
the lesson's one or two methods left to write, at two levels (:data:`LEVELS`) --
``contract``, each method's contract and the properties that judge it, and
``guided``, which also says what to do and which parts of minizero exist for it --
and :func:`check`, which runs the same property tests the package's stages pass --
equivalence to single-device training, bytes and memory against the formulas,
overlap where the lab is about overlap -- on either, and reports the smallest
failing case in plain words.

    python -m minizero lab ddp my_ddp.py                 # a copy of the contract skeleton to work in
    python -m minizero lab ddp my_ddp.py --level guided  # or of the guided one (hints)
    python -m minizero check ddp --impl my_ddp.py        # judge it
"""
from __future__ import annotations

import shutil
from pathlib import Path

from .catalogue import LABS, LEVELS, Lab, check_lab_name
from .check import Report, check


def skeleton_path(lab: str, level: str = LEVELS[0]) -> Path:
    """The blank skeleton of ``lab`` at ``level`` (``contract`` or ``guided``; read it, copy it with :func:`start`
    to work in)."""
    return check_lab_name(lab).skeleton_at(level)


def start(lab: str, to: str | Path | None = None, level: str = LEVELS[0]) -> Path:
    """Copy ``lab``'s skeleton at ``level`` to ``to`` (default ``lab_<name>.py`` here) and return the path; an
    existing file is never overwritten -- it is your work."""
    spec = check_lab_name(lab)
    source = spec.skeleton_at(level)
    target = Path(to if to is not None else f"lab_{spec.name.replace('-', '_')}.py")
    if target.exists():
        raise FileExistsError(f"{target} exists; check it with python -m minizero check {spec.name} --impl {target}, "
                              f"or name another file")
    shutil.copyfile(source, target)
    return target


__all__ = ["LABS", "LEVELS", "Lab", "Report", "check", "skeleton_path", "start"]

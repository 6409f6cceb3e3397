"""The learner's file, loaded in every rank of a pool -- never in the checker's own process.

Pools fork once and live on, so a class defined in a file the learner wrote
after the fork is unknown to them.  What travels to the ranks is therefore a
:class:`Impl` -- a path, or an importable class -- and each rank loads it
itself (cached by the file's modification time: an edited file is reloaded).
The checker never imports it: a file that loops or exits at import would take
the checker with it.  In the ranks, under the checker's deadline, it is a verdict.
"""
from __future__ import annotations

import hashlib
import importlib
import importlib.util
import inspect
import os
import sys
from dataclasses import dataclass
from pathlib import Path

from ...comm import BACKENDS
from ...stages import Stage
from .catalogue import Lab
from .mistakes import LAB_MISTAKES

_loaded: dict[tuple[str, int], object] = {}


def shown(path: str) -> str:
    """A file as a verdict names it: relative to where the checker runs when both are inside the directory that
    holds the package (a lesson's ``../minizero/course/labs/skeletons/contract/ddp.py``), so the words do not depend on the
    machine; anywhere else, as it is."""
    home = Path(__file__).resolve().parents[3]  # the directory holding minizero/: the repository's root
    inside = all(Path(p).resolve().is_relative_to(home) for p in (path, os.getcwd()))
    return os.path.relpath(path) if inside else path


@dataclass(frozen=True)
class Impl:
    """A learner's implementation of a lab: a file (``path``) or a class (``module``:``qualname``)."""

    lab: Lab
    path: str | None = None
    module: str | None = None
    qualname: str | None = None
    given: str | None = None  # the path as the learner wrote it, for messages

    @classmethod
    def of(cls, lab: Lab, impl) -> "Impl":
        """``impl``: a path, a class, or None for the package's own (the answer key)."""
        impl = lab.answer if impl is None else impl
        if isinstance(impl, type):
            return cls(lab, module=impl.__module__, qualname=impl.__qualname__)
        path = Path(impl).expanduser().resolve()
        if not path.is_file():
            raise FileNotFoundError(f"no file {str(impl)!r} to check for lab {lab.name!r}; start one with "
                                    f"python -m minizero lab {lab.name} FILE")
        return cls(lab, path=str(path), given=str(impl))

    @property
    def label(self) -> str:
        return shown(self.given or self.path) if self.path else f"{self.module}.{self.qualname}"

    def cls(self) -> type:
        """The learner's class, loaded in this process."""
        if self.path is None:
            target = importlib.import_module(self.module)
            for part in self.qualname.split("."):
                target = getattr(target, part)
            return target
        return find_class(load_file(self.path), self.lab)

    @property
    def key(self) -> str:
        """The learner's stage or backend, by this name, in a copy of the registry."""
        return f"lab-{self.lab.name}"

    def stand_in_stages(self) -> dict:
        """The registry the checker's own process uses: the answer key stands in for the learner's class, whose
        file only the ranks import.  What the checker asks of it there -- the options a stage accepts, the
        same-casts reference's buffers -- is the given machinery's, which the learner's class inherits."""
        if issubclass(self.lab.answer, Stage):
            return {**LAB_MISTAKES, self.key: self.lab.answer}
        return LAB_MISTAKES

    def stages(self) -> dict:
        """The lab's registry (with the known mistakes) plus the learner's stage -- or, for the ring lab,
        the learner's ring installed as a collective backend, which any stage can run over."""
        cls = self.cls()
        if issubclass(cls, Stage):
            return {**LAB_MISTAKES, self.key: cls}
        BACKENDS[self.key] = cls  # under a name of its own, beside ring and native, which keep theirs
        return LAB_MISTAKES


def load_file(path: str):
    """Import the file at ``path`` as a module of its own (reloaded when the file changes)."""
    mtime = os.stat(path).st_mtime_ns
    module = _loaded.get((path, mtime))
    if module is None:
        name = "minizero_lab_" + hashlib.sha1(f"{path}:{mtime}".encode()).hexdigest()[:12]
        spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        try:
            spec.loader.exec_module(module)
        except BaseException:  # a sys.exit() at import too: the next load runs the file again
            del sys.modules[name]
            raise
        _loaded[(path, mtime)] = module
    return module


def find_class(module, lab: Lab) -> type:
    """The one class the file defines that is a :class:`Stage` (or, for the ring lab, a ``Comm``)."""
    kind = lab.kind
    own = [obj for _, obj in inspect.getmembers(module, inspect.isclass)
           if obj.__module__ == module.__name__ and issubclass(obj, kind)]
    if not own:
        raise TypeError(f"{module.__file__} defines no subclass of {kind.__name__}: the lab {lab.name!r} checks the "
                        f"{kind.__name__} it defines (start from the skeleton: python -m minizero lab {lab.name} FILE)")
    leaves = [c for c in own if not any(o is not c and issubclass(o, c) for o in own)]
    if len(leaves) > 1:
        raise TypeError(f"{module.__file__} defines {len(leaves)} {kind.__name__} classes "
                        f"({', '.join(c.__name__ for c in leaves)}); the lab {lab.name!r} checks one: keep one")
    return leaves[0]

"""Printing source in a lesson, so that a test can hold it to today's code.

A lesson that shows the code it teaches prints it with :func:`show_source`.  The first line names the object and its
file relative to the installed package; ``tests/test_lesson_outputs.py`` finds that line in every committed output,
renders the same object from today's source and compares: a lesson whose printed code has gone stale fails the
suite instead of teaching last month's code.  The path is relative on purpose -- no committed output may carry the
path of the machine that ran it.
"""
from __future__ import annotations

import importlib
import inspect
import sys
from pathlib import Path

#: The first line of every printed source; the test finds blocks by it.
HEADER = "# source of {name}  ({path}{cut})"


def _relative_path(obj) -> str:
    """``minizero/comm/ring.py``, ``torch/distributed/...``: the file from its top-level package down."""
    file = Path(inspect.getsourcefile(inspect.unwrap(obj))).resolve()  # a decorated function's own file, as getsource
    top = sys.modules[obj.__module__.split(".")[0]]
    root = Path(top.__file__).resolve().parent.parent
    return file.relative_to(root).as_posix()


def _cut(lines: list[str], start: str | None, stop: str | None, name: str) -> list[str]:
    """The lines from the first holding ``start`` through the first after it holding ``stop``."""
    first = 0 if start is None else next((i for i, line in enumerate(lines) if start in line), None)
    if first is None:
        raise ValueError(f"{name}: no line holds {start!r}; pass a start marker that its source contains")
    last = len(lines) - 1 if stop is None else next(
        (i for i in range(first, len(lines)) if stop in lines[i]), None)
    if last is None:
        raise ValueError(f"{name}: no line from {start!r} on holds {stop!r}")
    return lines[first:last + 1]


def render_source(obj, start: str | None = None, stop: str | None = None) -> str:
    """The header line, then the object's source (or the lines from ``start`` through ``stop``)."""
    name = f"{obj.__module__}.{obj.__qualname__}"
    lines = _cut(inspect.getsource(obj).splitlines(), start, stop, name)
    cut = "" if start is None and stop is None else f", lines {start!r} to {stop!r}"
    return "\n".join([HEADER.format(name=name, path=_relative_path(obj), cut=cut), *lines])


def show_source(obj, start: str | None = None, stop: str | None = None) -> None:
    """Print :func:`render_source` -- the one way a lesson shows code."""
    print(render_source(obj, start, stop))


def resolve(path: str):
    """The object at a dotted ``path``: the longest importable module, then attributes -- how a header's name (or a
    production table's torch name) is read back."""
    parts = path.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for name in parts[cut:]:
            obj = getattr(obj, name)  # AttributeError: the name is not there
        return obj
    raise ImportError(f"no module of {path!r} imports")

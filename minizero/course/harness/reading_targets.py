"""What a reader of the library must open, measured: file sizes, repeated code, and the lines one step runs.

Three targets keep the library readable as it grows (issue 44), each measured here and printed by
``python scripts/targets.py``, and held by ``tests/test_targets.py``:

* no library file over :data:`MAX_FILE_LINES` lines -- one idea a file;
* no run of :data:`MIN_RUN` lines repeated anywhere in the library -- written once, called by name;
* following one training step of a stage opens at most :data:`STEP_LINES` library lines: the whole files the
  step runs a line of (:mod:`minizero.course.harness.step_trace`), outside ``comm/`` (read once, in lesson 1)
  and the training loop (read once, in lesson 3).

"The library" is ``minizero/`` without ``course/``: what a learner reads and a user imports.
"""
from __future__ import annotations

import re
from collections import defaultdict
from pathlib import Path

from ...stages import ZeRO2, ZeRO3

LIBRARY = Path(__file__).resolve().parents[2]  # minizero/
MAX_FILE_LINES = 300
MIN_RUN = 6
STEP_LINES = {ZeRO2.name: 1300, ZeRO3.name: 1600}
#: Read once for every stage, so not counted against one stage's step (the old hand-typed table left them out too).
READ_ONCE = ("comm/", "run/train.py")


def library_files() -> list[Path]:
    return sorted(p for p in LIBRARY.rglob("*.py") if not p.relative_to(LIBRARY).parts[0] == "course")


def line_count(path: Path) -> int:
    return len(path.read_text().splitlines())


def long_files(limit: int = MAX_FILE_LINES) -> dict[str, int]:
    """Library files over ``limit`` lines, with their length."""
    return {p.relative_to(LIBRARY).as_posix(): n for p in library_files() if (n := line_count(p)) > limit}


_SKIPPED = re.compile(r"^(#.*|import .*|from \S+ import .*|[\s()\[\]{},:]*)$")


def _code_lines(path: Path) -> list[tuple[str, int]]:
    """The lines that count, white space folded: not blank, not a comment, not an import, not lone punctuation."""
    kept = []
    for number, line in enumerate(path.read_text().splitlines(), 1):
        folded = " ".join(line.split())
        if not _SKIPPED.match(folded):
            kept.append((folded, number))
    return kept


def repeated_runs(files: list[Path] | None = None, length: int = MIN_RUN) -> list[tuple[str, str]]:
    """Every run of at least ``length`` counted lines that stands again elsewhere, to the letter, as a pair of
    places: ``("a.py:10-17", "b.py:40-47")``, each run once however long."""
    places = defaultdict(list)  # a window's text -> where it starts: (file, index among the file's counted lines)
    lines = {}
    for path in files if files is not None else library_files():
        name = path.relative_to(LIBRARY).as_posix() if path.is_relative_to(LIBRARY) else path.name
        lines[name] = _code_lines(path)
        for i in range(len(lines[name]) - length + 1):
            places["\n".join(text for text, _ in lines[name][i:i + length])].append((name, i))
    matched = {(a, i, b, j) for where in places.values() for k, (a, i) in enumerate(where) for b, j in where[k + 1:]
               if a != b or abs(i - j) >= length}
    runs = []
    for a, i, b, j in sorted(matched):
        if (a, i - 1, b, j - 1) in matched:
            continue  # inside a run that starts earlier
        end = 0
        while (a, i + end + 1, b, j + end + 1) in matched:
            end += 1
        last = end + length - 1
        runs.append((f"{a}:{lines[a][i][1]}-{lines[a][i + last][1]}", f"{b}:{lines[b][j][1]}-{lines[b][j + last][1]}"))
    return runs


def step_lines(files: dict[str, list[int]]) -> tuple[int, dict[str, int]]:
    """The library lines a reader opens to follow a step that ran ``files`` (traced: file -> lines run): the
    whole length of each file, outside :data:`READ_ONCE`."""
    opened = {name: line_count(LIBRARY / name) for name in files if not name.startswith(READ_ONCE)}
    return sum(opened.values()), opened

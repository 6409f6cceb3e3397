"""The course as it is on disk: every lesson notebook with its title, and the labs that end it.

The summary lesson prints its table of the course from here, not from a list typed once and left behind: a
lesson or a lab added later appears in it without anyone remembering to (issue 47 found the typed table ending
at lesson 15 and its sentence on the labs missing two).
"""
from __future__ import annotations

import json
from pathlib import Path

from ..labs import LABS

#: The repository's lessons, beside the package (an editable install; ``make install`` makes one).
LESSONS = Path(__file__).resolve().parents[3] / "lessons"


def lessons(folder: str | Path = LESSONS) -> list[tuple[str, str]]:
    """``(file name, title)`` of every lesson notebook in ``folder``, in order; the title is the first line of
    its first cell, without the ``# Lesson N —`` before it."""
    found = []
    for path in sorted(Path(folder).glob("[0-9][0-9]_*.ipynb")):
        title = "".join(json.loads(path.read_text())["cells"][0]["source"]).splitlines()[0].lstrip("# ")
        found.append((path.name, title.split(" — ", 1)[1] if title.startswith("Lesson ") else title))
    return found


def course_table(folder: str | Path = LESSONS) -> str:
    """The course in Markdown: each lesson, its title, and the labs (``python -m minizero check LAB``) it ends in."""
    rows = ["| lesson | what it builds and proves | its labs |", "|---|---|---|"]
    for name, title in lessons(folder):
        labs = [f"`{lab}`" for lab, spec in LABS.items() if Path(spec.lesson).name == name]
        rows.append(f"| {name[:2]} | {title} | {', '.join(labs) or '—'} |")
    return "\n".join(rows)

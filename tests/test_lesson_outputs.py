"""What a lesson prints is today's, and is nobody's machine.

* Every block of source a lesson prints went through :func:`minizero.course.harness.show.show_source`; rendered again from
  today's code it must read the same, line for line.  A lesson that calls ``inspect.getsource`` itself escapes the
  check, so that is refused too.
* No committed output holds an absolute path: a learner reading the notebook on the web should not see the path of
  the machine that ran it (and a path is a sign the output depends on where it ran).
"""
from __future__ import annotations

import ast
import json
import re
from itertools import zip_longest
from pathlib import Path

import pytest

from minizero.course.harness.show import render_source, resolve

LESSONS = sorted((Path(__file__).resolve().parent.parent / "lessons").glob("*.ipynb"))
HEADER = re.compile(r"^# source of (\S+)  \(([^,()]+)(?:, lines (.+) to (.+))?\)$")
#: A path from the root of a file system: /home/..., /tmp/..., a venv's site-packages, C:\...
ABSOLUTE = re.compile(r"(?<![\w.:/~-])/(?:home|work|tmp|Users|root|usr|opt|var|private|mnt|srv|etc|nix)/"
                      r"|site-packages|[A-Za-z]:\\\\")


def _cells(path: Path):
    return json.loads(path.read_text())["cells"]


def _texts(cell) -> list[str]:
    """Every text a code cell's committed outputs hold (streams, results, errors)."""
    texts = []
    for out in cell.get("outputs", []):
        if "text" in out:
            texts.append("".join(out["text"]))
        for mime, value in out.get("data", {}).items():
            if mime.startswith("text/") or mime == "application/json":
                texts.append(value if isinstance(value, str) else "".join(value))
        if "traceback" in out:
            texts.append("\n".join(out["traceback"]))
    return texts


def printed_sources(path: Path):
    """(cell number, name, printed lines, today's lines) for every source block the lesson printed."""
    for number, cell in enumerate(_cells(path)):
        if cell["cell_type"] != "code":
            continue
        for text in _texts(cell):
            lines = text.splitlines()
            for i, line in enumerate(lines):
                match = HEADER.match(line)
                if not match:
                    continue
                name, _, start, stop = match.groups()
                marks = [ast.literal_eval(m) if m is not None else None for m in (start, stop)]
                today = render_source(resolve(name), *marks).splitlines()
                yield number, name, lines[i:i + len(today)], today


@pytest.mark.parametrize("path", LESSONS, ids=lambda p: p.name)
def test_printed_source_is_todays(path):
    for number, cell in enumerate(_cells(path)):
        if cell["cell_type"] == "code":
            assert "getsource(" not in "".join(cell["source"]), (
                f"{path.name} cell {number} prints source with inspect.getsource: print it with "
                f"minizero.course.harness.show.show_source, which the suite holds to today's code")
    for number, name, printed, today in printed_sources(path):
        assert printed == today, (
            f"{path.name} cell {number} prints {name} as it was, not as it is: re-execute the lesson "
            f"(first difference at line {next(i for i, (a, b) in enumerate(zip_longest(printed, today)) if a != b)})")


@pytest.mark.parametrize("path", LESSONS, ids=lambda p: p.name)
def test_no_output_holds_an_absolute_path(path):
    for number, cell in enumerate(_cells(path)):
        if cell["cell_type"] != "code":
            continue
        for text in _texts(cell):
            found = ABSOLUTE.search(text)
            assert found is None, (f"{path.name} cell {number} prints a path of the machine that ran it: "
                                   f"...{text[max(0, found.start() - 60):found.end() + 60]}...")


def test_the_checks_can_fail(tmp_path):
    """A stale block and a path are found: the two checks above are not vacuous."""
    from minizero.course.harness.show import HEADER as FORMAT
    stale = FORMAT.format(name="minizero.course.harness.show.show_source", path="minizero/course/harness/show.py", cut="")
    nb = {"cells": [{"cell_type": "code", "source": "", "outputs": [
        {"output_type": "stream", "name": "stdout", "text": stale + "\ndef show_source(obj):\n    pass\n"},
        {"output_type": "stream", "name": "stderr", "text": "warning in /home/someone/x.py line 3"}]}]}
    path = tmp_path / "00_stale.ipynb"
    path.write_text(json.dumps(nb))
    with pytest.raises(AssertionError, match="as it was, not as it is"):
        test_printed_source_is_todays(path)
    with pytest.raises(AssertionError, match="prints a path"):
        test_no_output_holds_an_absolute_path(path)
    assert next(printed_sources(path))[3][1].startswith("def show_source(")


#: ``lesson 7, "Bytes: the same as DDP, by measurement"`` -- how the summary points at a section of a lesson.
SECTION = re.compile(r'lesson (\d+), (?:"([^"]+)"|“([^”]+)”)')


def headings(number: int) -> set[str]:
    """The section headings of lesson ``number``, as written after the #s."""
    (path,) = [p for p in LESSONS if p.name.startswith(f"{number:02d}_")]
    return {line.lstrip("#").strip() for cell in _cells(path) if cell["cell_type"] == "markdown"
            for line in "".join(cell["source"]).splitlines() if line.startswith("#")}


def missing_sections(text: str) -> list[str]:
    """Each ``lesson N, "heading"`` in ``text`` whose lesson has no such heading."""
    return [f'lesson {m[1]}, "{m[2] or m[3]}"' for m in SECTION.finditer(text)
            if (m[2] or m[3]) not in headings(int(m[1]))]


def test_the_summary_points_at_sections_that_exist():
    """The summary's myths table sends a reader to sections by name: a renamed heading must fail here, not on the web."""
    summary = "".join("".join(c["source"]) for c in _cells(LESSONS[-1]) if c["cell_type"] == "markdown")
    assert LESSONS[-1].name.startswith("99_") and len(SECTION.findall(summary)) >= 10
    assert missing_sections(summary) == []
    assert missing_sections('lesson 7, "A heading nobody wrote"') == ['lesson 7, "A heading nobody wrote"']

"""A tighter read (issue 47): one claim a sentence -- every lesson's prose averages under 20 words a sentence, and
no sentence runs past 40.  Prose is the markdown cells less headings, tables, code (fenced or indented) and HTML;
inline code and maths count as one word; a list item starts a sentence; "e.g.", "i.e.", "et al." end none."""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

LESSONS = sorted((Path(__file__).parent.parent / "lessons").glob("*.ipynb"))
MEAN_WORDS, MOST_WORDS = 20, 40
ABBREVIATIONS = ("e.g.", "i.e.", "et al.", "vs.", "cf.", "etc.")


def sentences(markdown: str) -> list[str]:
    text = re.sub(r"```.*?```", "\n", markdown, flags=re.S)
    kept = []
    for line in text.splitlines():
        if not line.strip() or line.lstrip().startswith(("#", "|", "<")) or line.startswith("    "):
            kept.append("\n")  # a paragraph ends: nothing runs on across it
        elif re.match(r"\s*([*-]|\d+\.)\s", line):  # a list item: a sentence of its own, less its marker
            kept += ["\n", re.sub(r"^\s*([*-]|\d+\.)\s", "", line)]
        else:
            kept.append(line)
    text = re.sub(r"\$[^$]*\$", "X", re.sub(r"`[^`]*`", "X", " ".join(kept)))
    for abbreviation in ABBREVIATIONS:
        text = text.replace(abbreviation, abbreviation.replace(".", ""))
    return [s for para in text.split("\n") for s in re.split(r"(?<=[.!?])\s+", para) if len(s.split()) > 2]


def test_the_counter_splits_where_a_reader_stops():
    assert [len(s.split()) for s in sentences("One two three. Four five six, e.g. seven!\n\n# A heading here\n"
                                               "* an item of four\n* and `a.b()` here")] == [3, 5, 4, 3]


@pytest.mark.parametrize("lesson", LESSONS, ids=lambda p: p.stem)
def test_every_lesson_reads_one_claim_a_sentence(lesson):
    prose = [s for cell in json.loads(lesson.read_text())["cells"] if cell["cell_type"] == "markdown"
             for s in sentences("".join(cell["source"]))]
    words = [len(s.split()) for s in prose]
    assert sum(words) / len(words) < MEAN_WORDS, f"{lesson.name}: {sum(words) / len(words):.1f} words a sentence"
    longest = max(prose, key=lambda s: len(s.split()))
    assert len(longest.split()) <= MOST_WORDS, f"{lesson.name}: {len(longest.split())} words: {longest[:200]}"

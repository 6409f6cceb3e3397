"""The docs are claims: every row of docs/bad-inputs.md names a test that exists and asserts the message quoted;
every stage option is in docs/commands.md; every link between the README and the docs pages resolves; the README
stays short."""
from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def rows():
    for line in (ROOT / "docs" / "bad-inputs.md").read_text().splitlines():
        cells = [c.strip() for c in re.split(r"(?<!\\)\|", line.strip())[1:-1]]
        if len(cells) == 4 and cells[0].isdigit():
            yield int(cells[0]), cells[1], cells[2], cells[3].strip("`")


def test_there_are_at_least_25_rows_numbered_in_order():
    numbers = [n for n, *_ in rows()]
    assert len(numbers) >= 25 and numbers == list(range(1, len(numbers) + 1))


def _unescaped(source: str) -> str:
    """The test's source with regex escapes undone, so a quoted message matches a pattern that checks it."""
    once = re.sub(r"\\(.)", r"\1", source)
    return re.sub(r"\\(.)", r"\1", once)  # "\\(" in a non-raw string is escaped twice


def test_every_row_names_a_test_that_asserts_its_message():
    """The quoted message must appear, literally, in the test's module: what the test asserts."""
    problems = []
    for number, _, said, test in rows():
        path, name = test.split("::")
        source = (ROOT / path).read_text()
        functions = {node.name for node in ast.walk(ast.parse(source)) if isinstance(node, ast.FunctionDef)}
        if name not in functions:
            problems.append(f"row {number}: {test} does not exist")
            continue
        for quoted in re.findall(r"`([^`]+)`", said):
            for piece in (p.strip() for p in quoted.replace("error: ", "").split("…") if p.strip()):
                if piece not in source and piece not in _unescaped(source):
                    problems.append(f"row {number}: {test} does not check {piece!r}")
    assert not problems, "\n".join(problems)


def test_every_stage_option_flag_is_in_the_commands_reference():
    """docs/commands.md's option lists name every flag a stage declares (the CLI builds them from the declarations):
    a new option is documented, or this fails naming it."""
    from minizero.course.harness import option_flags
    from minizero.stages import STAGES
    commands = (ROOT / "docs" / "commands.md").read_text()
    flags = {option.flag for cls in STAGES.values() for option in cls.options
             if option_flags.on_command_line(option) and option.name != "precision"}
    missing = sorted(flag for flag in flags if flag not in commands)
    assert not missing, f"docs/commands.md names no {missing}: add them to the options of compare and train"


def markdown_pages() -> list[Path]:
    """The README and every page under docs/: the pages a reader follows links between."""
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def file_links(text: str) -> list[str]:
    """The targets of the markdown links and images in ``text`` that point at a file of this repository: not a
    web address, not an anchor on the same page; the ``#anchor`` of a link to another page is cut off."""
    text = re.sub(r"```.*?```", "", text, flags=re.DOTALL)  # a code block's brackets are code, not links
    text = re.sub(r"`[^`\n]*`", "code", text)  # and so are a code span's
    targets = re.findall(r"\]\(([^()\s]+)(?:\s+\"[^\"]*\")?\)", text)
    return [t.split("#")[0] for t in targets if not re.match(r"[a-z][a-z0-9+.-]*:", t) and not t.startswith("#")]


def test_every_docs_link_in_the_readme_exists():
    """Every relative link in README.md and docs/*.md -- `(docs/commands.md)`, `(commands.md#train)`,
    `(../lessons/01_....ipynb)` -- names a file that exists, read from the page's own folder, as GitHub reads it."""
    broken = [f"{page.relative_to(ROOT)}: ({target})" for page in markdown_pages()
              for target in file_links(page.read_text()) if not (page.parent / target).exists()]
    assert not broken, "links to files that do not exist:\n" + "\n".join(broken)


def test_the_links_are_found():
    """The link finder itself: a page without a link it can see would pass the test above vacuously."""
    assert file_links("see [a](docs/a.md#b), ![p](p.png \"t\"), [w](https://x.org/y.md), [s](#here), `[c](c.md)`"
                      ) == ["docs/a.md", "p.png"]
    assert "docs/commands.md" in file_links((ROOT / "README.md").read_text())


README_MOST_LINES = 300


def test_the_readme_is_short():
    """The README is a newcomer's page, read in ten minutes; the reference lives under docs/ and is linked from it."""
    lines = len((ROOT / "README.md").read_text().splitlines())
    assert lines < README_MOST_LINES, (f"README.md has {lines} lines, {README_MOST_LINES} or more: move the reference "
                                       "into a page under docs/ and link it")


def glossary_places() -> list[str]:
    """Every code span of the glossary's "where" column."""
    places = []
    for line in (ROOT / "docs" / "glossary.md").read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 4 and cells[0] not in ("word", "---"):
            places += re.findall(r"`([^`]+)`", cells[2])
    return places


def test_the_glossary_names_what_exists():
    """Each dotted name in the glossary's "where" column imports, each path exists: the words stay the code's."""
    from minizero.course.harness.show import resolve

    places = glossary_places()
    assert len([p for p in places if p.startswith("minizero")]) >= 15, places
    missing = []
    for place in places:
        if "/" in place:
            if not (ROOT / place).exists():
                missing.append(place)
        elif place.startswith("minizero."):
            try:
                resolve(place)
            except (ImportError, AttributeError):
                missing.append(place)
    assert not missing, f"docs/glossary.md names what the code does not have: {missing}"


"""docs/bad-inputs.md is a claim: every row names a test that exists and asserts the message quoted."""
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

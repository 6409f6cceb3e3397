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


def test_every_stage_option_flag_is_in_the_readme():
    """The README's option lists name every flag a stage declares (the CLI builds them from the declarations):
    a new option is documented, or this fails naming it."""
    from minizero.course.harness import option_flags
    from minizero.stages import STAGES
    readme = (ROOT / "README.md").read_text()
    flags = {option.flag for cls in STAGES.values() for option in cls.options
             if option_flags.on_command_line(option) and option.name != "precision"}
    missing = sorted(flag for flag in flags if flag not in readme)
    assert not missing, f"README.md names no {missing}: add them to the options of compare and train"

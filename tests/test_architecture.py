"""The layers hold: comm -> layout/buckets -> stages -> loop -> lab/CLI/lessons.

* the core never imports the lab harness (``minizero.lab``);
* no import cycle anywhere in the package;
* nothing outside ``stages/`` names a stage, but the lab's registry and user-facing text: the rest reads
  each stage's facts from its class;
* each ZeRO stage derives from the common base alone, not from another stage.
"""
from __future__ import annotations

import ast
from pathlib import Path

import minizero
from minizero.stages import STAGES, ZeRO, ZeRO1, ZeRO2, ZeRO3

ROOT = Path(minizero.__file__).parent


def modules() -> dict[str, Path]:
    out = {}
    for path in ROOT.rglob("*.py"):
        parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def imports(name: str, path: Path, known: dict) -> set[str]:
    """Every minizero module ``name`` imports, anywhere in its body."""
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[:len(anchor) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            submodules = {f"{base}.{alias.name}" for alias in node.names if f"{base}.{alias.name}" in known}
            found |= submodules
            if len(submodules) < len(node.names):  # names defined in the module (or package) itself
                found.add(base)
    return {m for m in found if m in known and m != name}


def graph() -> dict[str, set[str]]:
    known = modules()
    return {name: imports(name, path, known) for name, path in known.items()}


def test_the_core_never_imports_the_lab():
    offenders = {m: sorted(d for d in deps if d.startswith("minizero.lab"))
                 for m, deps in graph().items() if not m.startswith("minizero.lab") and m != "minizero.__main__"}
    assert not any(offenders.values()), {m: d for m, d in offenders.items() if d}


def test_no_import_cycles():
    edges, state, cycles = graph(), {}, []

    def visit(m, path):
        state[m] = "open"
        for d in sorted(edges[m]):
            if state.get(d) == "open":
                cycles.append(path[path.index(d):] + [d] if d in path else [m, d])
            elif d not in state:
                visit(d, path + [d])
        state[m] = "done"

    for m in sorted(edges):
        if m not in state:
            visit(m, [m])
    assert not cycles, cycles


def _strings_outside_docs(tree):
    docstrings = {id(node.body[0].value) for node in ast.walk(tree)
                  if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef)) and node.body
                  and isinstance(node.body[0], ast.Expr) and isinstance(node.body[0].value, ast.Constant)}
    command_names = {id(k) for node in ast.walk(tree) if isinstance(node, ast.Assign)
                     and any(isinstance(t, ast.Name) and t.id == "BENCHES" for t in node.targets)
                     for k in node.value.keys}  # `bench ddp`, `bench zero3`: commands, user-facing
    return [node for node in ast.walk(tree) if isinstance(node, ast.Constant) and isinstance(node.value, str)
            and id(node) not in docstrings | command_names]


def test_nothing_outside_stages_names_a_stage():
    found = []
    for name, path in modules().items():
        if name.startswith("minizero.stages"):
            continue
        for node in _strings_outside_docs(ast.parse(path.read_text())):
            if node.value in STAGES:
                found.append(f"{path.relative_to(ROOT.parent)}:{node.lineno} {node.value!r}")
    assert not found, found


def test_each_zero_stage_derives_only_from_the_common_base():
    for stage in (ZeRO1, ZeRO2, ZeRO3):
        assert stage.__bases__ == (ZeRO,), (stage, stage.__bases__)

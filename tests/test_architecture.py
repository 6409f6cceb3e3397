"""The folders are the layers, and the imports keep to them.

* ``LAYERS``: a folder imports only from its own layer and the layers below it; folders on one layer do not import
  each other.  The library (``comm`` up to ``run``) never imports the course, which sits on top of it;
* the top level of ``minizero/`` holds the doors (``__init__.py``, ``__main__.py``) and the folders, nothing else;
* the README's folder list names the same folders as ``LAYERS``;
* no import cycle anywhere in the package;
* nothing outside ``stages/`` names a stage, but the course's registry and user-facing text: the rest reads
  each stage's facts from its class;
* each ZeRO stage derives from the common base alone, not from another stage.
"""
from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent / "minizero"  # read, not imported: the graph holds while a stage breaks
README = ROOT.parent / "README.md"

#: The layers, top first: the doors, the course, then the library from the training loop down to the collectives.
#: A folder imports from its own layer and the layers below; two folders on one layer never import each other.
LAYERS = [
    ["__main__", "__init__"],
    ["course"],
    ["run", "checkpoint", "observe"],
    ["stages"],
    ["compress"],
    ["parts", "costs"],
    ["comm"],
]


def modules() -> dict[str, Path]:
    out = {}
    for path in ROOT.rglob("*.py"):
        parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def imports(name: str, path: Path, known: dict) -> dict[str, int]:
    """Every minizero module ``name`` imports, anywhere in its body, with the line of its first import."""
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    found = {}
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[:len(anchor) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            names = {f"{base}.{alias.name}" for alias in node.names if f"{base}.{alias.name}" in known}
            if len(names) < len(node.names):  # names defined in the module (or package) itself
                names.add(base)
        else:
            continue
        for m in names:
            if m in known and m != name:
                found[m] = min(found.get(m, node.lineno), node.lineno)
    return found


def graph() -> dict[str, set[str]]:
    known = modules()
    return {name: set(imports(name, path, known)) for name, path in known.items()}


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
    from minizero.stages import STAGES

    found = []
    for name, path in modules().items():
        if name.startswith("minizero.stages"):
            continue
        for node in _strings_outside_docs(ast.parse(path.read_text())):
            if node.value in STAGES:
                found.append(f"{path.relative_to(ROOT.parent)}:{node.lineno} {node.value!r}")
    assert not found, found


def test_each_zero_stage_derives_only_from_the_common_base():
    from minizero.stages import ZeRO, ZeRO1, ZeRO2, ZeRO3

    for stage in (ZeRO1, ZeRO2, ZeRO3):
        assert stage.__bases__ == (ZeRO,), (stage, stage.__bases__)


#: Stages allowed a longer chain, and why.  ps-async is ps with stale pulls: lesson 13 reads it as a diff against ps;
#: hsdp is ZeRO-3 on a 2-D mesh: its file holds the mesh and the two-level reduction, the rest is ZeRO-3's; zeropp is
#: ZeRO-3 with ZeRO++'s gathers: its file holds how they travel (qwZ, hpZ), the rest is ZeRO-3's.
LONGER_CHAIN = {"ps-async": 4, "hsdp": 4, "zeropp": 4}


def class_chain(stage: type) -> list[str]:
    """The classes of ``stage``'s MRO defined inside minizero (torch's nn.Module and object are not)."""
    return [c.__name__ for c in stage.__mro__ if c.__module__.startswith("minizero.")]


def test_every_stage_is_at_most_three_classes_deep():
    """The stage, at most one family class (ZeRO), and Stage: a reader follows one step without climbing a
    hierarchy, and a template method cannot hide a stage's collectives in a base class."""
    from minizero.stages import STAGES

    too_deep = {name: class_chain(cls) for name, cls in STAGES.items() if len(class_chain(cls)) > LONGER_CHAIN.get(name, 3)}
    assert not too_deep, too_deep
    assert class_chain(STAGES["zero2"]) == ["ZeRO2", "ZeRO", "Stage"]  # (the check sees minizero's classes)


def test_each_core_stage_file_calls_its_collectives():
    """Each core stage's own file calls the collectives of its step on the communication layer -- not a
    base class's template, not the compression module."""
    wanted = {"ddp.py": ["all_reduce"], "ddp_bucketed.py": ["all_reduce"], "zero1.py": ["reduce_scatter", "all_gather"],
              "zero2.py": ["reduce_scatter", "all_gather"], "zero3.py": ["reduce_scatter", "all_gather"],
              "hsdp.py": ["reduce_scatter", "all_reduce"]}
    for file, collectives in wanted.items():
        calls = {node.func.attr for node in ast.walk(ast.parse((ROOT / "stages" / file).read_text()))
                 if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                 and isinstance(node.func.value, ast.Attribute)
                 and node.func.value.attr.endswith("comm")}  # self.comm, or HSDP's mesh: shard_comm, replica_comm
        assert set(collectives) <= calls, (file, "calls self.comm. (or shard_comm, replica_comm)", sorted(calls),
                                           "but not", set(collectives) - calls)


def test_no_comm_module_but_star_and_not_compress_mentions_the_servers():
    """The parameter server's servers are its stage's and comm/star.py's business, not the core's."""
    offenders = [str(path.relative_to(ROOT)) for path in [*(ROOT / "comm").glob("*.py"), *(ROOT / "compress").glob("*.py")]
                 if path.name != "star.py" and re.search(r"\bservers\b", path.read_text())]
    assert not offenders, offenders


def folder(module: str) -> str:
    """``minizero.stages.zero2`` -> ``stages``; ``minizero.__main__`` -> ``__main__``; ``minizero`` -> ``__init__``."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def layer_violations(edges: dict[str, set[str]]) -> list[str]:
    """Every import that goes up a layer, or sideways between two folders of one layer."""
    level = {name: at for at, layer in enumerate(LAYERS) for name in layer}
    found = []
    for module, deps in sorted(edges.items()):
        for dep in sorted(deps):
            a, b = folder(module), folder(dep)
            if a == b:
                continue
            if a not in level or b not in level:
                found.append(f"{module} imports {dep}: {a if a not in level else b} is on no layer of LAYERS")
            elif level[a] >= level[b]:
                where = "the same layer as" if level[a] == level[b] else "a layer above"
                found.append(f"{module} ({a}/) imports {dep}, on {where} it ({b}/)")
    return found


def test_the_folders_are_the_layers():
    assert not layer_violations(graph()), "\n".join(layer_violations(graph()))


def test_an_upward_or_sideways_import_is_refused():
    edges = graph()
    upward = layer_violations({**edges, "minizero.comm.base": edges["minizero.comm.base"] | {"minizero.stages.zero2"}})
    assert upward == ["minizero.comm.base (comm/) imports minizero.stages.zero2, on a layer above it (stages/)"], upward
    sideways = layer_violations({**edges, "minizero.parts.flat": {"minizero.costs.formulas"}})
    assert sideways == ["minizero.parts.flat (parts/) imports minizero.costs.formulas, on the same layer as it (costs/)"]
    library = layer_violations({**edges, "minizero.run.train": {"minizero.course.harness.experiment"}})
    assert library and "a layer above it (course/)" in library[0], library


def test_the_top_level_holds_the_doors_and_the_folders():
    entries = {p.name for p in ROOT.iterdir() if p.name != "__pycache__"}
    folders = {name for layer in LAYERS[1:] for name in layer}
    assert entries == {"__init__.py", "__main__.py"} | folders, sorted(entries ^ ({"__init__.py", "__main__.py"} | folders))
    assert all((ROOT / name / "__init__.py").exists() for name in folders)


def test_the_readme_lists_the_folders():
    """The README's folder table ("What is here") has a row per folder, in the order of LAYERS (top first)."""
    text = README.read_text()
    section = text[text.index("## What is here"):]
    section = section[:section.index("\n## ", 1)]
    named = re.findall(r"^\| `minizero/(\w+)/` \|", section, re.MULTILINE)
    assert named == [name for layer in LAYERS[1:] for name in layer], named

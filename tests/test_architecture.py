"""The layers hold, and the README draws them as the imports are.

* the core never imports the lab harness (``minizero.lab``);
* no import cycle anywhere in the package;
* nothing outside ``stages/`` names a stage, but the lab's registry and user-facing text: the rest reads
  each stage's facts from its class;
* each ZeRO stage derives from the common base alone, not from another stage;
* the layer diagram in README.md ("## What is here") is the import graph, checked here at run time.

The diagram's modules are the entries of ``minizero/`` as a reader sees them: a file (``train.py``) or a
package with everything under it (``stages/``, ``comm/``); imports inside one package are its own business.
Three rules make a diagram true, and a drawing that merely avoids upward arrows is not enough:

1. **Nothing imports upward**: a module imports only modules on its own layer or on layers below it.
2. **Nothing is drawn lower than it is used**: every module below the top layer is imported by a module on
   the layer directly above it.  The diagram says "this layer is built from the one below"; ``memory.py``
   drawn among the parts the stages use, when only the lab imports it, broke exactly this.
3. **The top layer holds the doors**: only modules nothing imports (``__main__.py``, ``__init__.py``).
   Without it, one layer holding everything would pass rules 1 and 2.

Rule 2 is chosen over its mirror ("every module above the bottom imports from the layer below"): that one
would push ``train.py``, ``memory.py`` and ``timeline.py``, which import nothing of minizero, down beside
``comm/``, answering "what does it need" where a reader asks "who uses it".
"""
from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent / "minizero"  # read, not imported: the graph holds while a stage breaks
README = ROOT.parent / "README.md"


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


#: Stages allowed a longer chain, and why.  ps-async is ps with stale pulls: lesson 11 reads it as a diff against ps;
#: hsdp is ZeRO-3 on a 2-D mesh: its file holds the mesh and the two-level reduction, the rest is ZeRO-3's.
LONGER_CHAIN = {"ps-async": 4, "hsdp": 4}


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


# --- the README's diagram -------------------------------------------------------------------------------------
#
# Its syntax, for a human first:
#
#     __main__.py · __init__.py   the doors                    <- a layer's line: names, two spaces, a description
#           │                                                   <- a line holding only │ ends a layer
#     lab/                        experiments ...
#                                 more description             <- an indented line continues the description
#     train.py                    the one training loop        <- the next unindented line: same layer
#
# A name is ``file.py`` or ``package/``; names are separated by `` · `` or spaces.

MODULE = re.compile(r"\w+\.py|\w+/")


def unit(path: Path) -> str:
    """The diagram's name for the module at ``path``: ``train.py``, or ``stages/`` for all of stages/."""
    parts = path.relative_to(ROOT).parts
    return f"{parts[0]}/" if len(parts) > 1 else parts[0]


def unit_imports() -> dict[tuple[str, str], str]:
    """(importer, imported) between diagram names -> one import that makes it, as ``file:line imports module``."""
    known, found = modules(), {}
    for name, path in sorted(known.items()):
        for target, line in sorted(imports(name, path, known).items()):
            edge = (unit(path), unit(known[target]))
            if edge[0] != edge[1]:
                found.setdefault(edge, f"{path.relative_to(ROOT.parent)}:{line} imports {target}")
    return found


def readme_diagram(text: str) -> tuple[str, int]:
    """The fenced block of "## What is here", and the README line its first line is on."""
    lines = text.splitlines()
    start = lines.index("## What is here")
    fence = next(i for i in range(start, len(lines)) if lines[i].startswith("```"))
    end = next(i for i in range(fence + 1, len(lines)) if lines[i].startswith("```"))
    return "\n".join(lines[fence + 1:end]), fence + 2


def _names(line: str) -> list[str]:
    """The names a layer's line draws: what stands before its first run of two spaces."""
    head = re.split(r"\s{2,}", line.strip(), maxsplit=1)[0]
    return [token for token in re.split(r"[\s·]+", head) if token]


def parse(diagram: str, first_line: int) -> tuple[list[list[tuple[str, int]]], list[str]]:
    """The layers, top first, each a list of (name, README line); and what in the text is not a diagram."""
    layers, layer, problems, drawn_lines = [], [], [], 0
    for number, line in enumerate(diagram.splitlines(), first_line):
        if line.strip() == "│":
            if not drawn_lines:
                problems.append(f"README.md:{number}: a layer separator with no layer above it; remove one of the │ lines")
            if layer:
                layers.append(layer)
            layer, drawn_lines = [], 0
        elif line.strip() and not line[0].isspace():
            drawn_lines += 1
            for token in _names(line):
                if MODULE.fullmatch(token):
                    layer.append((token, number))
                else:
                    problems.append(f"README.md:{number}: {token!r} is not a module name; a layer's line starts with "
                                    "names (`file.py` or `package/`, separated by ` · `), then two spaces, then the description")
    if layer:
        layers.append(layer)
    return layers, problems


def _layer_text(layers: list[list[tuple[str, int]]], index: int) -> str:
    lines = sorted({number for _, number in layers[index]})
    names = [name for name, _ in layers[index]]
    shown = " · ".join(names[:6]) + (f" · … {len(names) - 6} more" if len(names) > 6 else "")
    where = f"README.md:{lines[0]}" + (f"-{lines[-1]}" if len(lines) > 1 else "")
    return f"{'the top layer' if index == 0 else 'the layer'} at {where} ({shown})"


def _breaks(level: dict[str, int], edges) -> int:
    """How many times the drawing ``level`` (name -> layer, 0 on top) breaks the three rules."""
    count = sum(level[a] > level[b] for a, b in edges if a in level and b in level)
    for name, at in level.items():
        users = {level[a] for a, b in edges if b == name and a in level}
        count += bool(users) if at == 0 else at - 1 not in users
    return count


def _where_to(name: str, level: dict[str, int], edges, layers, now: int | None = None) -> str:
    """Where to draw ``name`` (on layer ``now`` if drawn), the others staying: the move leaving the fewest rules broken.

    Among equals: an existing layer before a new one, then the layer directly below its lowest user (rule 2's aim).
    """
    undrawn = sorted(a for a, b in edges if b == name and a not in level)
    if undrawn:
        return f"It is imported by {', '.join(undrawn)}, which the diagram lacks: draw {' and '.join(undrawn)} first"
    below_users = max((level[a] + 1 for a, b in edges if b == name and a in level), default=0)
    moves = []  # (rules broken after it, a new layer?, distance from below its lowest user, layer, the words for it)
    for at in range(len(layers)):
        moves.append((_breaks({**level, name: at}, edges), 0, abs(at - below_users), at, _layer_text(layers, at)))
    for at in range(len(layers) + 1):
        shifted = {other: there + (there >= at) for other, there in level.items()}
        where = (f"a new layer below {_layer_text(layers, at - 1)}" if at == len(layers)
                 else f"a new layer above {_layer_text(layers, at)}")
        moves.append((_breaks({**shifted, name: at}, edges), 1, abs(at - below_users), at, where))
    broken, new, _, at, where = min(moves)
    if at == now and not new:
        return "No move of it alone helps: fix the other lines first"
    rest = f" (the best single move: {broken} rule breaks remain, named on the other lines)" if broken else ""
    return f"Draw it on {where}{rest}"


def _without(level: dict[str, int], name: str) -> dict[str, int]:
    return {other: at for other, at in level.items() if other != name}


def check(diagram: str, first_line: int, edges: dict[tuple[str, str], str], names: set[str]) -> list[str]:
    """What is wrong with ``diagram`` (README text) as a drawing of ``edges`` between the modules ``names``.

    Each problem names the module, the import and the README line to change, and says where to draw it.
    """
    layers, problems = parse(diagram, first_line)
    if not layers:
        return problems + [f"README.md:{first_line}: the diagram has no layers"]
    level, line = {}, {}
    for index, layer in enumerate(layers):
        for name, number in layer:
            if name not in names:
                problems.append(f"README.md:{number} draws {name}, which is not a module of minizero/: remove it "
                                f"(the modules: {' '.join(sorted(names))})")
            elif name in level:
                problems.append(f"README.md:{number} draws {name} again (it is on README.md:{line[name]}): remove one")
            else:
                level[name], line[name] = index, number
    for name in sorted(names - set(level)):
        problems.append(f"{name} is on no line of the diagram. {_where_to(name, level, edges, layers)}")
    for (a, b), why in sorted(edges.items()):
        if a in level and b in level and level[a] > level[b]:
            problems.append(f"{a} (README.md:{line[a]}) imports {b} (README.md:{line[b]}), a layer above it: {why}. "
                            f"Draw {b} on a layer at or below README.md:{line[a]}, or {a} on one at or above "
                            f"README.md:{line[b]}, or drop the import")
    for name in sorted(level):
        users = sorted(a for a, b in edges if b == name and a in level)
        if any(b == name and a not in level for a, b in edges):
            continue  # judged once its importers are drawn
        if level[name] == 0 and users:
            problems.append(f"{name} (README.md:{line[name]}) is on the top layer, which holds only what nothing imports, "
                            f"but {users[0]} imports it ({edges[(users[0], name)]}). "
                            f"{_where_to(name, _without(level, name), edges, layers, level[name])}")
        elif level[name] > 0 and not any(level[a] == level[name] - 1 for a in users):
            drawn_users = ", ".join(f"{a} (README.md:{line[a]})" for a in users) or "nothing"
            problems.append(f"{name} (README.md:{line[name]}) is drawn below {_layer_text(layers, level[name] - 1)}, "
                            f"but nothing there imports it; it is imported by {drawn_users}. "
                            f"{_where_to(name, _without(level, name), edges, layers, level[name])}")
    return problems


def _package_names() -> set[str]:
    return {unit(path) for path in modules().values()}


def test_the_readme_diagram_is_the_import_graph():
    diagram, first_line = readme_diagram(README.read_text())
    problems = check(diagram, first_line, unit_imports(), _package_names())
    assert not problems, "README.md's layer diagram disagrees with the imports:\n" + "\n".join(problems)


def _moved(diagram: str, name: str, beside: str) -> str:
    """``diagram`` with ``name`` taken off its line and drawn first on the line of ``beside``."""
    out = []
    for line in diagram.splitlines():
        if line and not line[0].isspace():
            names = _names(line)
            rest = re.split(r"\s{2,}", line.strip(), maxsplit=1)[1:]
            if name in names:
                names.remove(name)
            if beside in names:
                names.insert(0, name)
            line = "  ".join([" · ".join(names) or " ", *rest])
        out.append(line)
    return "\n".join(out)


def test_a_wrong_diagram_is_refused():
    """The checker is not vacuous: the mistake this test was written for, and others, are each refused."""
    diagram, first_line = readme_diagram(README.read_text())
    edges, names = unit_imports(), _package_names()
    assert ("lab/", "memory.py") in edges and ("stages/", "memory.py") not in edges, \
        "this test moves memory.py among the parts the stages use, which only the lab imports: pick another such module"

    drawn_as_a_part = check(_moved(diagram, "memory.py", beside="buckets.py"), first_line, edges, names)
    assert any(p.startswith("memory.py") and "nothing there imports it" in p and "lab/" in p for p in drawn_as_a_part), \
        drawn_as_a_part

    upward = check(diagram, first_line, {**edges, ("comm/", "stages/"): "minizero/comm/base.py:1 imports minizero.stages"},
                   names)
    assert any(p.startswith("comm/") and "imports stages/" in p and "comm/base.py:1" in p for p in upward), upward

    missing = check(diagram, first_line, edges, names | {"new.py"})
    assert any(p.startswith("new.py is on no line") and "top layer" in p for p in missing), missing

    unknown = check(diagram, first_line, edges, names - {"timeline.py"})
    assert any("draws timeline.py, which is not a module" in p for p in unknown), unknown

    everything_on_one_layer = check(" · ".join(sorted(names)), first_line, edges, names)
    assert any("top layer, which holds only what nothing imports" in p for p in everything_on_one_layer), \
        everything_on_one_layer

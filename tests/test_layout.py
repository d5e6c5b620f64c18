"""The package's import graph has no cycle.

Every ``.py`` file under ``src/zerodp`` is parsed with ``ast`` and every import of a zerodp
module becomes an edge: module-level imports, imports inside functions, and imports under
``if TYPE_CHECKING:`` alike (an annotation-only import still says that one module depends on
the other). Relative imports are resolved against the importing module's package. Importing a
package (``import zerodp.checkpoint``, ``from zerodp import checkpoint`` where ``checkpoint`` is
a package) is an edge to its ``__init__.py``; ``from pkg import name`` where ``pkg.name`` is a
module is an edge to that module, otherwise to ``pkg/__init__.py``. The parent packages Python
initializes on the way to a module are not edges (every module would otherwise depend on
``zerodp/__init__.py``).

No edge is excluded: the top-level ``zerodp/__init__.py`` takes part like any other module.
"""
from __future__ import annotations

import ast
from pathlib import Path
from typing import Optional

SRC = Path(__file__).resolve().parent.parent / "src"
PACKAGE = "zerodp"


def module_files(src: Path = SRC, package: str = PACKAGE) -> dict[str, Path]:
    """Dotted module name -> file, for every module and package under ``src/package``."""
    out = {}
    for path in sorted((src / package).rglob("*.py")):
        parts = list(path.relative_to(src).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def _resolve(importer: str, is_package: bool, level: int, module: Optional[str]) -> str:
    """The absolute name a (possibly relative) ``from ... import`` refers to."""
    if level == 0:
        return module or ""
    base = importer.split(".")
    if not is_package:
        base = base[:-1]
    if level > 1:
        base = base[:len(base) - (level - 1)]
    return ".".join(base + ([module] if module else []))


def import_edges(modules: dict[str, Path], package: str = PACKAGE) -> dict[str, dict[str, int]]:
    """Importer -> {imported module: line of the first such import}, within ``package``."""
    edges: dict[str, dict[str, int]] = {name: {} for name in modules}

    def add(importer: str, target: str, line: int) -> None:
        if target == importer or target not in modules:
            return
        edges[importer].setdefault(target, line)

    for name, path in modules.items():
        is_package = path.name == "__init__.py"
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.name == package or alias.name.startswith(package + "."):
                        add(name, alias.name, node.lineno)
            elif isinstance(node, ast.ImportFrom):
                base = _resolve(name, is_package, node.level, node.module)
                if base != package and not base.startswith(package + "."):
                    continue
                for alias in node.names:
                    sub = f"{base}.{alias.name}"
                    add(name, sub if sub in modules else base, node.lineno)
    return edges


def find_cycle(edges: dict[str, dict[str, int]]) -> Optional[list[str]]:
    """A cycle ``[a, b, ..., a]`` of the graph, or None (iterative depth-first search)."""
    WHITE, GREY, BLACK = 0, 1, 2
    color = dict.fromkeys(edges, WHITE)
    for start in sorted(edges):
        if color[start] != WHITE:
            continue
        color[start] = GREY
        stack = [(start, iter(sorted(edges[start])))]
        while stack:
            node, children = stack[-1]
            child = next(children, None)
            if child is None:
                color[node] = BLACK
                stack.pop()
            elif color[child] == GREY:
                path = [n for n, _ in stack]
                return path[path.index(child):] + [child]
            elif color[child] == WHITE:
                color[child] = GREY
                stack.append((child, iter(sorted(edges[child]))))
    return None


def describe(cycle: list[str], edges: dict[str, dict[str, int]], modules: dict[str, Path]) -> str:
    lines = [f"import cycle of {len(cycle) - 1} modules:"]
    for a, b in zip(cycle, cycle[1:]):
        where = modules[a].relative_to(SRC)
        lines.append(f"  {a} imports {b}  ({where}:{edges[a][b]})")
    return "\n".join(lines)


def test_the_import_graph_has_no_cycle():
    modules = module_files()
    assert f"{PACKAGE}.core.engine" in modules and f"{PACKAGE}.checkpoint.save" in modules
    edges = import_edges(modules)
    assert sum(map(len, edges.values())) > 50, "too few import edges found: the parser misses imports"
    cycle = find_cycle(edges)
    assert cycle is None, describe(cycle, edges, modules)


def test_checkpoints_see_the_engine_only_through_its_view():
    """``checkpoint/`` and ``core/view.py`` import neither ``core/engine.py`` nor
    ``core/engine_api.py``, not even for annotations: a checkpoint is given a ``CheckpointView``."""
    modules = module_files()
    edges = import_edges(modules)
    engine = {f"{PACKAGE}.core.engine", f"{PACKAGE}.core.engine_api"}
    importers = [m for m in modules if m == f"{PACKAGE}.checkpoint" or m.startswith(f"{PACKAGE}.checkpoint.")]
    importers.append(f"{PACKAGE}.core.view")
    found = [f"{m} imports {t} ({modules[m].relative_to(SRC)}:{edges[m][t]})"
             for m in importers for t in sorted(engine & edges[m].keys())]
    assert not found, "\n".join(found)


def test_the_checker_finds_cycles_of_every_import_form(tmp_path):
    """Module-level, function-level and TYPE_CHECKING imports, absolute and relative, and
    package imports each close a cycle the checker reports."""
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    files = {
        "__init__.py": "",
        "a.py": "from .b import f\n",
        "b.py": "def f():\n    from .sub import c\n",
        "sub/__init__.py": "",
        "sub/c.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import pkg.d\n",
        "d.py": "from . import sub\n",
        "sub/e.py": "",
    }
    for rel, text in files.items():
        (pkg / rel).write_text(text, encoding="utf-8")
    modules = module_files(tmp_path, "pkg")
    edges = import_edges(modules, "pkg")
    assert edges["pkg.a"] == {"pkg.b": 1}
    assert edges["pkg.b"] == {"pkg.sub.c": 2}
    assert edges["pkg.sub.c"] == {"pkg.d": 3}
    assert edges["pkg.d"] == {"pkg.sub": 1}
    assert find_cycle(edges) is None
    (pkg / "sub/__init__.py").write_text("from ..a import f\n", encoding="utf-8")
    edges = import_edges(module_files(tmp_path, "pkg"), "pkg")
    cycle = find_cycle(edges)
    assert cycle is not None and cycle[0] == cycle[-1]
    assert set(cycle) == {"pkg.a", "pkg.b", "pkg.sub.c", "pkg.d", "pkg.sub"}


# -- sizes and private names ----------------------------------------------------------------

MAX_LINES = 600


def test_no_source_file_is_over_the_size_line():
    """A file past ~600 lines holds more than one idea: split it along them."""
    sizes = {path: len(path.read_text(encoding="utf-8").splitlines()) for path in module_files().values()}
    assert len(sizes) > 40
    over = [f"{p.relative_to(SRC)}: {n} lines" for p, n in sorted(sizes.items()) if n > MAX_LINES]
    assert not over, "\n".join(over)


#: the classes whose private members stay inside core/: the engine and the gradient reducer
PRIVATE_OWNERS = {"core/engine.py": ("ZeroEngine",), "core/engine_api.py": ("EngineAPI",),
                  "core/reduce.py": ("GradReducer",)}


def private_members(path: Path, classes: tuple[str, ...]) -> set[str]:
    """The ``_name`` attributes ``classes`` in ``path`` define: methods and ``self._name = ...``."""
    names = set()
    for node in ast.parse(path.read_text(encoding="utf-8")).body:
        if not (isinstance(node, ast.ClassDef) and node.name in classes):
            continue
        for sub in ast.walk(node):
            if isinstance(sub, (ast.FunctionDef, ast.AsyncFunctionDef)):
                names.add(sub.name)
            elif isinstance(sub, ast.Attribute) and isinstance(sub.ctx, ast.Store) \
                    and isinstance(sub.value, ast.Name) and sub.value.id == "self":
                names.add(sub.attr)
    return {n for n in names if n.startswith("_") and not n.startswith("__")}


def private_reads(path: Path, names: set[str]) -> list[tuple[int, str]]:
    """``(line, text)`` for each ``x._name`` in ``path`` with ``_name`` in ``names`` and ``x`` not
    ``self`` (a class's own private members are its business)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Attribute) and node.attr in names:
            if not (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls")):
                found.append((node.lineno, ast.unparse(node)))
    return found


def test_nothing_outside_core_reads_the_engines_or_reducers_private_members():
    pkg = SRC / PACKAGE
    names = set()
    for rel, classes in PRIVATE_OWNERS.items():
        names |= private_members(pkg / rel, classes)
    assert {"_checkpointer", "_apply_update"} <= names, "the collector misses the engine's private members"
    found = findings(lambda path: private_reads(path, names), lambda rel: "core" in rel.split("/"))
    assert not found, "\n".join(found)


def findings(check, skip) -> list[str]:
    """``file:line: text`` of ``check(path)`` over the package's files whose path relative to the
    package (``core/engine.py``) ``skip`` does not exclude."""
    pkg = SRC / PACKAGE
    return [f"{path.relative_to(SRC)}:{line}: {text}" for path in sorted(pkg.rglob("*.py"))
            if not skip(path.relative_to(pkg).as_posix()) for line, text in check(path)]


def test_the_private_read_checker_sees_reads_and_not_own_members(tmp_path):
    owner = tmp_path / "owner.py"
    owner.write_text("class E:\n    def __init__(self):\n        self._state = 1\n"
                     "    def _step(self):\n        return self._state\n", encoding="utf-8")
    names = private_members(owner, ("E",))
    assert names == {"_state", "_step"}
    reader = tmp_path / "reader.py"
    reader.write_text("def f(engine):\n    engine._step()\n    return self._state, engine.public\n",
                      encoding="utf-8")
    assert private_reads(reader, names) == [(2, "engine._step")]


#: A stage-3 unit's state, which only the stage-3 object and the unit's own module change.
UNIT_STATE = {"pins", "pending_backward", "held", "in_backward", "suspended"}
UNIT_STATE_OWNERS = {"core/gather.py", "core/sharded.py"}


def state_writes(path: Path, names: set[str]) -> list[tuple[int, str]]:
    """``(line, text)`` for each assignment (plain or augmented) to ``x.name`` with ``name`` in
    ``names`` and ``x`` not ``self``."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        targets = node.targets if isinstance(node, ast.Assign) else \
            [node.target] if isinstance(node, ast.AugAssign) else []
        for t in targets:
            if isinstance(t, ast.Attribute) and t.attr in names \
                    and not (isinstance(t.value, ast.Name) and t.value.id == "self"):
                found.append((node.lineno, ast.unparse(t)))
    return found


def test_only_the_stage3_object_changes_unit_state():
    found = findings(lambda path: state_writes(path, UNIT_STATE), lambda rel: rel in UNIT_STATE_OWNERS)
    assert not found, "\n".join(found)


def test_the_unit_state_checker_sees_writes(tmp_path):
    f = tmp_path / "w.py"
    f.write_text("def f(engine, unit):\n    unit.pins = 0\n    unit.pending_backward += 1\n"
                 "    self.held = True\n    x = unit.held\n", encoding="utf-8")
    assert state_writes(f, UNIT_STATE) == [(2, "unit.pins"), (3, "unit.pending_backward")]


#: Library modules that still import ``zerodp.tools`` (the estimate and the metrics monitor that
#: ``zerodp/__init__`` exports, and two entry points that hand over to the command line). No other
#: module outside ``tools/`` may; none may import ``examples/``.
IMPORTS_TOOLS_FOR_NOW = {"zerodp", "zerodp.launcher.runner", "zerodp.utils.zero_to_fp32"}


def test_the_library_does_not_import_the_tools_or_the_examples():
    modules = module_files()
    edges = import_edges(modules)
    outside = [m for m in edges if not m.startswith(("zerodp.tools", "zerodp.examples"))]
    examples = sorted(f"{m} imports {t}" for m in outside for t in edges[m] if t.startswith("zerodp.examples"))
    assert not examples, "\n".join(examples)
    tools = {m for m in outside for t in edges[m] if t.startswith("zerodp.tools")}
    assert tools <= IMPORTS_TOOLS_FOR_NOW, sorted(tools - IMPORTS_TOOLS_FOR_NOW)
    assert tools == IMPORTS_TOOLS_FOR_NOW, f"no longer importing tools/: {sorted(IMPORTS_TOOLS_FOR_NOW - tools)}"
